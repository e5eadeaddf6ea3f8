"""A checkpoint computed cannot run stops it with one line naming the file and the fix (exit 2),
never a traceback; a hub id says to download it first, and one already in the hub cache is used."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from computed.config import DEFAULT_MODEL_DIR, ComputedConfig, resolve_model
from tests.daemons import REPO


def _checkpoint(tmp_path: Path, name: str, *, config: dict | None = None, weights: bool = True) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    base = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config if config is not None else base))
    for file in DEFAULT_MODEL_DIR.iterdir():
        if file.name != "config.json" and (weights or file.suffix != ".safetensors"):
            (folder / file.name).symlink_to(file)
    return folder


def _start(model: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "computed",
            "--model",
            model,
            "--listen",
            "127.0.0.1:0",
            "--blockd",
            "127.0.0.1:1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _base() -> dict:
    return json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())


@pytest.mark.parametrize(
    ("name", "config", "weights", "names", "fix"),
    [
        (
            "mistral",
            {**_base(), "architectures": ["MistralForCausalLM"]},
            True,
            "config.json",
            "LlamaForCausalLM",
        ),
        (
            "no-heads",
            {k: v for k, v in _base().items() if k != "num_attention_heads"},
            True,
            "config.json",
            "num_attention_heads",
        ),
        ("no-weights", None, False, "no-weights", "download the weights"),
    ],
)
def test_a_checkpoint_error_is_one_line(
    tmp_path: Path, name: str, config: dict | None, weights: bool, names: str, fix: str
) -> None:
    folder = _checkpoint(tmp_path, name, config=config, weights=weights)
    result = _start(str(folder))
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert last.startswith(f"computed: {folder}") and names in last and fix in last, last


def test_a_hub_id_says_download_first() -> None:
    with pytest.raises(ValueError, match=r"hf download Qwen/Qwen3-0\.6B --local-dir models/Qwen3-0\.6B"):
        ComputedConfig(model=resolve_model("Qwen/Qwen3-0.6B"))


def test_a_hub_id_in_the_local_cache_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("acme/tiny") == snapshot
    assert resolve_model(str(DEFAULT_MODEL_DIR)) == DEFAULT_MODEL_DIR
