"""Load a Hugging Face Llama-family checkpoint (config.json + *.safetensors) into `CausalLM`.

No transformers import: tensors are read with `safetensors` by their HF names.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from computed import kernels
from computed.model.config import ModelConfig
from computed.model.llama import CausalLM

# Tensors some checkpoints carry that the model recomputes or does not need.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_SAMPLES_PER_FILE = 8  # data chunks hashed into the revision, besides the header
_SAMPLE_BYTES = 4096


class CheckpointError(ValueError):
    """The checkpoint's tensors do not fit its config (missing, unexpected or misshapen), or its
    weights are absent; the message is one line naming the file and what to do."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with what identifies its K/V (part of the cache namespace)."""

    model: CausalLM
    config: ModelConfig
    model_id: str  # e.g. "Qwen/Qwen3-0.6B" or the checkpoint's directory name
    revision: str  # 16 hex chars fingerprinting config.json and the weights files
    path: Path
    dtype: torch.dtype
    device: torch.device


def load_model(
    path: str | Path, device: torch.device | str, dtype: torch.dtype, products: torch.dtype | None = None
) -> LoadedModel:
    """Build the model on `device` in `dtype` from a checkpoint directory.

    `products=torch.bfloat16` (CPU float32 only; `native_bfloat16` says when it runs): every
    weight rounded to bfloat16 (as loading in bfloat16 would), the model in float32, and its
    products' inputs rounded to bfloat16 with float32 sums (`CausalLM.pack_projections`):
    bfloat16's arithmetic where it is twice as fast, float32's residual stream, norms and
    softmax elsewhere.

    Raises FileNotFoundError (no config/weights), UnsupportedModelError (architecture or
    option we do not run) or CheckpointError (tensors that do not match the config).
    """
    path, device = Path(path), torch.device(device)
    assert products in (None, torch.bfloat16), f"products in {products}"
    assert products is None or (device.type == "cpu" and dtype == torch.float32), (
        "bfloat16 products: CPU float32"
    )
    config = ModelConfig.from_dir(path)
    files = weight_files(path)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = dict(model.named_parameters())  # a tied lm_head shares the embedding's entry
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no dict
                if name in expected:
                    tensor = _checked(f.get_tensor(name), expected[name], name)
                    if products == torch.bfloat16:
                        tensor = tensor.to(torch.bfloat16)
                    state[name] = tensor.to(device, dtype)
                elif not _is_ignorable(name, config):
                    raise CheckpointError(
                        f"{file}: unexpected tensor {name!r}: the weights do not match config.json "
                        f"(another architecture or a quantized checkpoint?); use the checkpoint's own files"
                    )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"{path}: the weights file lacks {len(missing)} tensors config.json needs, e.g. {missing[:3]}; "
            f"download the checkpoint again (all its *.safetensors files)"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # assign=True replaced the embedding; point the head at the new one
    model.requires_grad_(False).eval()
    model.fuse_projections()
    model.pack_projections(products or torch.float32)
    return LoadedModel(
        model=model,
        config=config,
        model_id=model_id(path),
        revision=revision(path),
        path=path,
        dtype=dtype,
        device=device,
    )


def native_bfloat16(device: torch.device) -> bool:
    """Whether a bfloat16 model runs here as a float32 model with bfloat16 products
    (`load_model(..., torch.float32, products=torch.bfloat16)`, K/V kept in bfloat16): on CPU
    where the native kernels load. Elsewhere it loads in bfloat16 and runs torch's ops."""
    return device.type == "cpu" and kernels.pack_linear_weight_bf16_dot() is not None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: from its index json if any, else by glob."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        fix = (
            f"it has {', '.join(others[:3])}: convert them to safetensors"
            if others
            else "download the weights too (e.g. `hf download ORG/NAME --local-dir DIR`)"
        )
        raise CheckpointError(f"{path}: no *.safetensors weights; {fix}")
    absent = [file.name for file in files if not file.is_file()]
    if absent:
        raise CheckpointError(
            f"{index}: names {len(absent)} weights files that are not there, e.g. {absent[0]}; "
            f"download the checkpoint again"
        )
    return files


def model_id(path: Path) -> str:
    """`_name_or_path` when it names a hub repo, else the HF-cache repo name, else the dir name."""
    name = json.loads((path / "config.json").read_text()).get("_name_or_path") or ""
    if name and not name.startswith(("/", ".", "~")) and not Path(name).exists():
        return name
    resolved = path.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent.name.removeprefix("models--").replace("--", "/")
    return resolved.name


def revision(path: Path) -> str:
    """A cheap, stable fingerprint of config.json and the weights.

    Hashes each weights file's name, size, safetensors header and a few evenly spaced
    data chunks: a few dozen KB of reads however large the model, yet two fine-tunes of
    one architecture (identical headers) still differ.
    """
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in weight_files(path):
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(header_len))
            data_start, data_len = 8 + header_len, size - 8 - header_len
            for i in range(_SAMPLES_PER_FILE):
                f.seek(data_start + data_len * i // _SAMPLES_PER_FILE)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _checked(tensor: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.shape != param.shape:
        raise CheckpointError(
            f"{name}: checkpoint shape {tuple(tensor.shape)}, config.json wants {tuple(param.shape)}; "
            f"the weights and config.json are of different models"
        )
    if not tensor.is_floating_point():
        raise CheckpointError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")
    return tensor


def _is_ignorable(name: str, config: ModelConfig) -> bool:
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return True
    return name.endswith(_IGNORED_SUFFIXES)
