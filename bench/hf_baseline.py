"""The reference: Hugging Face transformers `generate`, greedy, batched, left-padded, KV cache on.

EOS is disabled (as `ignore_eos` on our side) so both produce exactly `max_new_tokens`
per prompt and the token counts compare one to one.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HfRun:
    outputs: list[list[int]]  # generated ids per prompt, in prompt order
    wall_s: float

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


class HfGenerator:
    """One loaded model; `generate` runs prompts in batches of `batch_size`."""

    def __init__(self, model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> None:
        import torch
        import transformers

        from computed.host_allocator import keep_large_buffers

        # The same allocator setting computed runs with: the baseline must be the best
        # its library does on this machine, not slower for a reason we removed on our side.
        keep_large_buffers()
        self.torch = torch
        self.device = device
        self.model = (
            transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=getattr(torch, dtype), attn_implementation="sdpa"
            )
            .to(device)
            .eval()
        )
        config = copy.deepcopy(self.model.generation_config)
        config.eos_token_id = None  # never stop early: exactly max_new_tokens each
        config.do_sample = False
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        config.pad_token_id = self.pad_id
        self.generation_config = config

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], batch_size: int
    ) -> HfRun:
        """Greedy outputs. A per-prompt `max_new_tokens` list generates each batch to its
        longest request and keeps only what each prompt asked for (HF has no per-row stop)."""
        torch = self.torch
        wants = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        outputs: list[list[int]] = []
        started = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, prompt in enumerate(batch):  # left padding
                ids[row, width - len(prompt) :] = torch.tensor(list(prompt))
                mask[row, width - len(prompt) :] = 1
            new = max(wants[i : i + batch_size])
            config = copy.deepcopy(self.generation_config)
            config.max_new_tokens = new
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    generation_config=config,
                )
            generated = out[:, width:].tolist()
            assert all(len(g) == new for g in generated), "HF stopped early"
            outputs += [g[:want] for g, want in zip(generated, wants[i : i + batch_size])]
        if self.device != "cpu":
            torch.cuda.synchronize()
        return HfRun(outputs, time.perf_counter() - started)
