"""Tiny random-weight checkpoints for tests: see tools/tiny_models.py (bench uses them too)."""

from tools.tiny_models import (  # noqa: F401
    ARCHS,
    LLAMA3_ROPE_SCALING,
    TOKENIZER_VOCAB_SIZE,
    TinyModels,
    make_tiny_model,
)
