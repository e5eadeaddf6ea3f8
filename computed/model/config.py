"""Model configuration parsed from a Hugging Face checkpoint's `config.json`.

Only what changes the forward pass is kept, validated once on construction. Both the
classic (`rope_theta` + `rope_scaling`) and the transformers-5 (`rope_parameters`)
spellings of RoPE settings are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# HF `architectures[0]` -> our family name. The three share one implementation.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or option this implementation does not run, or its
    config.json lacks what the forward needs. `from_dir` prefixes the file, so the message is
    one line naming the file and what to do."""


# config.json keys the forward cannot do without (the others have Hugging Face's defaults).
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (`rope_type: "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise UnsupportedModelError(f"invalid llama3 rope scaling {self}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise UnsupportedModelError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor: {self}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder.

    Invariants: num_heads % num_kv_heads == 0 (grouped-query attention), head_dim is even
    (rotate-half RoPE), every eos id is inside the vocabulary.
    """

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # explicit for Qwen3 (may differ from hidden_size // num_heads)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None  # None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (always for Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json and generation_config.json merged, in order
    torch_dtype: str | None  # as saved, e.g. "bfloat16"; informative only: the loader picks the dtype

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise UnsupportedModelError(f"unknown architecture {self.architecture!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise UnsupportedModelError("rms_norm_eps and rope_theta must be positive")
        for token_id in (
            *self.eos_token_ids,
            *([self.bos_token_id] if self.bos_token_id is not None else []),
        ):
            if not 0 <= token_id < self.vocab_size:
                raise UnsupportedModelError(f"special token id {token_id} outside vocab {self.vocab_size}")

    @property
    def has_qk_norm(self) -> bool:
        """Qwen3 RMS-normalises each head of q and k before RoPE."""
        return self.architecture == "qwen3"

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` and, when present, `generation_config.json` from a checkpoint dir."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        generation_file = path / "generation_config.json"
        try:
            generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as error:
            raise UnsupportedModelError(
                f"{path}: a config file is not valid JSON ({error}); download it again"
            ) from None
        try:
            return cls.from_dict(config, generation)
        except UnsupportedModelError as error:
            raise UnsupportedModelError(f"{config_file}: {error}") from None

    @classmethod
    def from_dict(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        architectures = config.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
            named = ", ".join(architectures) if architectures else "no architecture"
            raise UnsupportedModelError(
                f"{named} is not supported: computed runs {', '.join(ARCHITECTURES)} checkpoints; "
                f"pick a model of those families"
            )
        architecture = ARCHITECTURES[architectures[0]]
        _reject_unsupported(config)
        missing = [key for key in REQUIRED_KEYS if not isinstance(config.get(key), int)]
        if missing:
            raise UnsupportedModelError(
                f"lacks {', '.join(missing)} (or not an integer), which the {architectures[0]} forward needs; "
                f"the file is incomplete: download the checkpoint again"
            )
        num_heads = config["num_attention_heads"]
        generation_config = generation_config or {}
        bos = config.get("bos_token_id")
        if bos is None:
            bos = generation_config.get("bos_token_id")
        theta, scaling = _parse_rope(config)
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # HF's Qwen2 attention hard-codes q/k/v biases; Llama and Qwen3 read the flag.
            attention_bias=True if architecture == "qwen2" else bool(config.get("attention_bias", False)),
            bos_token_id=bos,
            eos_token_ids=_merge_ids(config.get("eos_token_id"), generation_config.get("eos_token_id")),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        )


def _reject_unsupported(config: dict[str, Any]) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} not supported (only silu)")
    if config.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true not supported")
    if config.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention not supported")
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise UnsupportedModelError(
            f"layer_types {sorted(set(layer_types))} not supported (full_attention only)"
        )
    if config.get("pretraining_tp", 1) not in (1, None):
        raise UnsupportedModelError("pretraining_tp > 1 not supported")


def _parse_rope(config: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from either `rope_scaling` + `rope_theta` or `rope_parameters`."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or params
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if (scaling or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 not supported")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope type {rope_type!r} not supported (default or llama3 only)")
    try:
        return float(theta), Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise UnsupportedModelError(f"llama3 rope scaling lacks {missing}") from None


def _merge_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    merged: list[int] = []
    for value in values:
        for token_id in [value] if isinstance(value, int) else (value or []):
            if token_id not in merged:
                merged.append(token_id)
    return tuple(merged)
