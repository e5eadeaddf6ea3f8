"""The arithmetic of one forward, to say what a measured time could at best be.

`forward_macs(config, cached, new)` counts the multiply-adds of a forward over `new`
tokens whose first `cached` predecessors already have K/V in the pool:

- per new token and layer, the q/k/v and output projections and the gated MLP:
  hidden x (H + 2 Hkv) x D + H x D x hidden + 3 x hidden x intermediate;
- attention: the token at position p reads keys 0..p, a D-long product for its score and
  one for its weighted value, per query head and layer;
- the logits of the last token only (hidden x vocab), as a TTFT request samples one row.

Norms, rotary, softmax and sampling are left out: on the default model they are under 1%
of a prefill's multiply-adds. So `work_ratio(config, prefix, new)`, a warm request's
multiply-adds over its cold twin's (the same prompt with nothing cached), is the least
TTFT warm ÷ cold can be if the warm forward ran at the cold one's rate and nothing else
took time: what `bench.ttft` prints beside the measured ratio.
"""

from __future__ import annotations

from computed.model.config import ModelConfig


def forward_macs(config: ModelConfig, cached: int, new: int) -> int:
    """Multiply-adds of a forward over `new` tokens after `cached` cached ones (see module)."""
    assert cached >= 0 and new >= 1, (cached, new)
    hidden, dim = config.hidden_size, config.head_dim
    heads, kv_heads = config.num_heads, config.num_kv_heads
    per_token_layer = (
        hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden + 3 * hidden * config.intermediate_size
    )
    # token i of the new ones (position cached + i) reads cached + i + 1 keys
    pairs = new * cached + new * (new + 1) // 2
    attention = config.num_layers * heads * dim * 2 * pairs
    return new * config.num_layers * per_token_layer + attention + hidden * config.vocab_size


def work_ratio(config: ModelConfig, prefix: int, new: int) -> float:
    """A warm request's multiply-adds (`prefix` cached, `new` computed) over its cold twin's."""
    return forward_macs(config, prefix, new) / forward_macs(config, 0, prefix + new)
