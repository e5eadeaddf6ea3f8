"""The model layer: config, loader, Llama-family network, RoPE, tokenizer."""

from computed.model.config import ModelConfig, UnsupportedModelError
from computed.model.llama import CausalLM
from computed.model.loader import CheckpointError, LoadedModel, load_model, native_bfloat16
from computed.model.tokenizer import ChatTemplateError, IncrementalDecoder, Tokenizer

__all__ = [
    "CausalLM",
    "ChatTemplateError",
    "CheckpointError",
    "IncrementalDecoder",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "UnsupportedModelError",
    "load_model",
    "native_bfloat16",
]
