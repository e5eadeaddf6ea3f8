"""`python -m bench.attention_kernels`: the CPU attention kernels on the tiles a step makes.

Prints milliseconds per call for each tile shape (I items x Qm queries x Lm keys, the
default model's 8 query / 4 K/V heads x 32) and each way to run it: torch's fused CPU
flash kernel with each K/V head's query heads folded into its rows ("fold"), the same
kernel with K/V repeated per query head ("repeat"), and float32 batched matmuls with a
log-sum-exp ("matmul"); also a K/V gather from the pool by slots and by whole blocks,
with glibc's default allocator thresholds and with computed's (`host_allocator`); and
decode rows as a step runs them, 4 layers from cold caches: gather + "fold" against
`computed.kernels`' native paged decode kernel, which reads the pool in place; decode
rows in groups over shared prefixes, cascaded (each segment as one item) against flat (each
row reads it in its own item), float32 and bfloat16 pools, as `computed.attention` runs them; and the default model's linear
layers through `F.linear` (MKL) against the native `kvcache::packed_linear`; and
tiles of several queries per item as a step runs them: gather + torch's flash kernel
("fold", or "repeat" where causal) against the native paged flash kernel; and the merge
of rows read through several tiles, torch's ops against the native merge; and whole
decode steps, the modules' forward against `computed.model.native`'s. The
choices in `computed/attention.py` and `computed/model/layers.py` cite this table.
"""

from __future__ import annotations

import sys
import time
from functools import partial

import torch

HEADS, KV_HEADS, DIM, BLOCK = 8, 4, 32, 16
GROUP = HEADS // KV_HEADS
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
SHAPES = [  # (what, items, queries, keys)
    ("decode rows, private context", 64, 1, 128),
    ("decode rows, whole context", 64, 1, 1152),
    ("shared segment, 64 decode rows", 1, 64, 1024),
    ("shared segment, 63 x 64 prefill rows", 1, 4032, 1024),
    ("long shared segment, 16 decode rows", 1, 16, 4096),
    ("prefill chunk, causal", 1, 1088, 1088),
]


def timed(fn, repeats: int = 20) -> float:
    fn()
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def fold(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):  # q (I, Q, H, D), k/v (I, L, Hkv, D)
    items, width_q = q.shape[:2]
    qf = q.view(items, width_q, KV_HEADS, GROUP, DIM).permute(0, 2, 1, 3, 4).reshape(items, KV_HEADS, -1, DIM)
    return FLASH(qf, k.transpose(1, 2), v.transpose(1, 2), 0.0, False, scale=DIM**-0.5)


def repeat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    kh = k.transpose(1, 2).repeat_interleave(GROUP, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(GROUP, dim=1)
    return FLASH(q.transpose(1, 2), kh, vh, 0.0, False, scale=DIM**-0.5)


def matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    items, width_q = q.shape[:2]
    qf = q.view(items, width_q, KV_HEADS, GROUP, DIM).permute(0, 2, 1, 3, 4).reshape(items, KV_HEADS, -1, DIM)
    scores = qf @ k.permute(0, 2, 3, 1) * DIM**-0.5
    lse = scores.logsumexp(dim=-1, keepdim=True)
    return (scores - lse).exp_() @ v.transpose(1, 2), lse


def main() -> None:
    tuned = "--default-malloc" not in sys.argv
    if tuned:
        from computed.host_allocator import keep_large_buffers

        keep_large_buffers()
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, allocator thresholds "
        f"{'raised (computed)' if tuned else 'glibc default'}"
    )
    print(f"{'tile':40} {'I x Qm x Lm':>18} {'fold':>8} {'repeat':>8} {'matmul':>8}  (ms)")
    for what, items, width_q, width_k in SHAPES:
        q = torch.randn(items, width_q, HEADS, DIM)
        k, v = torch.randn(2, items, width_k, KV_HEADS, DIM).unbind(0)
        repeats = 5 if width_q * width_k > 10**6 else 20
        row = [timed(lambda f=f, q=q, k=k, v=v: f(q, k, v), repeats) for f in (fold, repeat, matmul)]
        print(f"{what:40} {f'{items} x {width_q} x {width_k}':>18} " + " ".join(f"{x:8.2f}" for x in row))
    pool = torch.randn(16384 * BLOCK, KV_HEADS * DIM)
    blocks = torch.randint(0, 16384, (64 * 70,))
    slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
    by_block = pool.view(16384, -1)
    print(
        f"gather 64 x 1,120 slots of K: by slot {timed(lambda: pool.index_select(0, slots)):.2f} ms, "
        f"by block {timed(lambda: by_block.index_select(0, blocks)):.2f} ms"
    )

    decode_rows()
    cascade()
    flash()
    linear()
    rotary()
    merge()
    step()


FLASH_TILES = [  # (what, items, queries, keys, causal)
    ("prefill, 4 unrelated prompts", 4, 1088, 1088, True),
    ("prefill, 1 prompt", 1, 1088, 1088, True),
    ("prefill, 64 new chunks of 64", 64, 64, 64, True),
    ("shared segment, 64 decode rows", 1, 64, 1024, False),
    ("shared segment, 63 x 64 prefill rows", 1, 4032, 1024, False),
    ("private contexts, 16 chunks of 64", 16, 64, 1024, False),
]


def flash() -> None:
    """Multi-query tiles: slots gather + torch's flash (as computed ran them before the
    native kernel) against `kvcache::paged_flash` reading the pool in place, and the same
    op on a bfloat16 pool (bfloat16 products: `--dtype bfloat16`)."""
    from computed import kernels

    op = kernels.paged_flash()
    if op is None:
        print(f"flash: native kernel unavailable ({kernels.error()})")
        return
    print(
        f"{'flash tile':40} {'I x Qm x Lm':>18} {'torch':>8} {'native':>8} {'ratio':>6} {'bf16 pool':>9}  (ms)"
    )
    for what, items, width_q, width_k, causal in FLASH_TILES:
        num_blocks = items * width_k // BLOCK + 8
        keys, values = torch.randn(2, num_blocks * BLOCK, KV_HEADS, DIM).unbind(0)
        blocks = torch.randperm(num_blocks)[: items * -(-width_k // BLOCK)].view(items, -1)
        slots = (
            (blocks[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(items, -1)[:, :width_k].contiguous()
        )
        lens = torch.full((items,), width_k)
        q = torch.randn(items, width_q, HEADS, DIM)

        def torch_path(q=q, keys=keys, values=values, slots=slots, causal=causal):
            k = keys.index_select(0, slots.view(-1)).view(*slots.shape, KV_HEADS, DIM)
            v = values.index_select(0, slots.view(-1)).view(*slots.shape, KV_HEADS, DIM)
            if causal:
                kh = k.transpose(1, 2).repeat_interleave(GROUP, dim=1)
                vh = v.transpose(1, 2).repeat_interleave(GROUP, dim=1)
                return FLASH(q.transpose(1, 2), kh, vh, 0.0, True, scale=DIM**-0.5)
            return fold(q, k, v)

        repeats = 3 if items * width_q * width_k > 10**6 else 20
        before = timed(torch_path, repeats)
        after = timed(
            lambda q=q, k=keys, v=values, s=slots, n=lens, c=causal: op(q, k, v, s, n, c, DIM**-0.5), repeats
        )
        kb, vb = keys.to(torch.bfloat16), values.to(torch.bfloat16)
        bf16 = timed(
            lambda q=q, k=kb, v=vb, s=slots, n=lens, c=causal: op(q, k, v, s, n, c, DIM**-0.5), repeats
        )
        print(
            f"{what:40} {f'{items} x {width_q} x {width_k}':>18} {before:8.2f} {after:8.2f} {before / after:6.2f}"
            f" {bf16:9.2f}"
        )


def cascade(layers: int = 4) -> None:
    """Groups of decode rows, each group sharing a prefix of its own, through
    `paged_attention` as a step runs them: every segment cascaded (threshold 0) against
    read flat by every row (threshold infinite), for a float32 and a bfloat16 pool (the
    cascade's gather differs). computed.attention's cascade rules (`WIDE_GATHER_CASCADE`,
    `NARROW_GATHER_CASCADE`) cite this table."""
    from computed.attention import AttentionBatch, SpanInput, paged_attention
    from computed.attention_plan import EVERY_SEGMENT, DecodeCascade
    from computed.kv_pool import KVPool

    print(f"decode rows over shared prefixes, {layers} layers: cascaded vs flat (ms, median of 9)")
    order = torch.randperm(8192).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        pool = KVPool(layers, 8192, BLOCK, KV_HEADS, DIM, dtype, torch.device("cpu"))
        pool.kv.normal_()
        for groups, rows, shared, private in (
            (4, 8, 1024, 40),
            (8, 4, 1024, 40),
            (8, 3, 1024, 40),
            (16, 2, 1024, 40),
            (4, 6, 512, 40),
            (8, 4, 512, 40),
            (8, 4, 256, 40),
            (1, 32, 1024, 100),
        ):
            free = iter(order[groups * shared // BLOCK :])
            spans = []
            for g in range(groups):
                prefix = list(range(g * shared // BLOCK, (g + 1) * shared // BLOCK))
                for r in range(rows):
                    own = [next(free) for _ in range(-(-(private + r + 1) // BLOCK))]
                    spans.append(SpanInput(prefix + own, shared + private + r, 1))
            q = torch.randn(len(spans), HEADS, DIM)
            kv = torch.randn(len(spans), KV_HEADS, DIM).to(dtype)
            line = f"  {str(dtype).removeprefix('torch.'):8} {groups} x {rows} rows x ({shared} shared + ~{private}):"
            for name, rule in (("cascaded", EVERY_SEGMENT), ("flat", DecodeCascade(2, 1 << 62))):
                batch = AttentionBatch.build(spans, BLOCK, "cpu", rule)

                def step(batch=batch, q=q, kv=kv, pool=pool) -> None:
                    for layer in range(layers):
                        paged_attention(q, kv, kv, layer, batch, pool, DIM**-0.5)

                times = sorted(timed(step, 3) for _ in range(9))
                line += f" {name} {times[4]:.2f}"
            print(line)


def linear() -> None:
    """The default model's products (the fused q/k/v, o, the fused gate/up, down and the
    vocabulary projection), hot and from cold caches (as a decode step finds its weights
    after its K/V reads): `F.linear` (MKL) against `kvcache::packed_linear` on a weight
    packed once, float32 and (the weights are bfloat16 values, as the built-in model's)
    at half the bytes (`pack_linear_weight_bf16`, the same products bit for bit). Sums
    per layer-and-head set show what a step pays."""
    import torch.nn.functional as F

    from computed import kernels

    pack, pack_bf16, op = (
        kernels.pack_linear_weight(),
        kernels.pack_linear_weight_bf16(),
        kernels.packed_linear(),
    )
    print(
        f"linear layers, x (M, K) W^T: F.linear vs native kvcache::packed_linear ({kernels.error() or 'built'}) (ms)"
    )
    junk = torch.zeros(48 * 2**20 // 4)

    def cold(fn, repeats: int = 30) -> float:
        total = 0.0
        for _ in range(repeats):
            junk.add_(1.0)  # evict the weights from the caches
            started = time.perf_counter()
            fn()
            total += time.perf_counter() - started
        return total / repeats * 1e3

    swiglu, silu_mul = kernels.packed_linear_swiglu(), kernels.silu_mul()
    for m in (1, 8, 64, 512, 2048):
        # hot F.linear, native, native bf16; cold F.linear, native, native bf16
        sums = [0.0] * 6
        for n, k in ((512, 256), (256, 256), (1376, 256), (256, 688), (4096, 256)):
            x, w = torch.randn(m, k), torch.randn(n, k).to(torch.bfloat16).float()
            runs = [partial(F.linear, x, w)]
            if op is not None:
                runs += [partial(op, x, pack(w), None, n), partial(op, x, pack_bf16(w), None, n)]
            times = [timed(run, 20) for run in runs] + [0.0] * (3 - len(runs))
            times += [cold(run) for run in runs] + [0.0] * (3 - len(runs)) if m <= 64 else [0.0] * 3
            sums = [a + b for a, b in zip(sums, times)]
            row = f"  {m} x {k} -> {n}: F.linear {times[0]:.3f}, native {times[1]:.3f}, bf16-packed {times[2]:.3f}"
            if m <= 64:
                row += f"; cold: {times[3]:.3f}, {times[4]:.3f}, {times[5]:.3f}"
            print(row)
        row = f"  {m} rows, the five products: F.linear {sums[0]:.2f}, native {sums[1]:.2f}, bf16-packed {sums[2]:.2f}"
        if m <= 64:
            row += f"; cold: {sums[3]:.2f}, {sums[4]:.2f}, {sums[5]:.2f}"
        print(row)
        if swiglu is not None:
            x = torch.randn(m, 256)
            packed = pack_bf16(torch.randn(1376, 256).to(torch.bfloat16).float())
            two = timed(lambda x=x, p=packed: silu_mul(op(x, p, None, 1376)), 20)
            fused = timed(lambda x=x, p=packed: swiglu(x, p, 1376), 20)
            print(
                f"  {m} rows, swiglu (256 -> 1376, activation): product + silu_mul {two:.3f}, fused {fused:.3f}"
            )


MERGES = [  # (what, rows, partials per row)
    ("chat prefill step: segment + context + new", 1009, 3),
    ("shared-prefix decode step: segment + private", 64, 2),
    ("shared-prefix prefill step: segment + new", 2048, 2),
]


def merge() -> None:
    """Rows read through several tiles: torch's merge (`computed.attention._merge`) against
    the native `kvcache::merge_partials`, both from the tiles' whole results."""
    from computed import kernels
    from computed.attention import _merge

    op = kernels.merge_partials()
    if op is None:
        print(f"merge: native kernel unavailable ({kernels.error()})")
        return
    print(f"{'merge of partials':48} {'rows x depth':>14} {'torch':>8} {'native':>8} {'ratio':>6}  (ms)")
    for what, rows, depth in MERGES:
        outs = [torch.randn(rows, HEADS, DIM) for _ in range(depth)]
        lses = [torch.randn(rows, HEADS) for _ in range(depth)]
        index = (torch.arange(depth)[None, :] * rows + torch.arange(rows)[:, None]).contiguous()
        before = timed(lambda o=outs, l=lses, i=index: _merge(o, l, i))
        after = timed(lambda o=outs, l=lses, i=index: op(o, l, i))
        print(f"{what:48} {f'{rows} x {depth}':>14} {before:8.2f} {after:8.2f} {before / after:6.2f}")


def rotary() -> None:
    """Rotary embedding of q (T, 8, 32) and k (T, 4, 32): torch ops against kvcache::rotary."""
    from computed import kernels
    from computed.model.rope import RotaryEmbedding, apply_rotary

    op = kernels.rotary()
    table = RotaryEmbedding(DIM, 10000.0, 8192)
    print(f"rotary, q and k: torch ops vs native kvcache::rotary ({kernels.error() or 'built'}) (ms)")
    for tokens in (8, 64, 4352):
        q, k = torch.randn(tokens, HEADS, DIM), torch.randn(tokens, KV_HEADS, DIM)
        cos, sin = table.cos_sin(torch.arange(tokens), tokens - 1, torch.float32)
        args = (q, k, cos, sin)

        def torch_ops(q=q, k=k, cos=cos, sin=sin) -> None:
            apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        row = f"  {tokens} tokens: torch {timed(torch_ops, 50):.3f}"
        if op is not None:
            row += f", native {timed(lambda args=args: op(*args), 50):.3f}"
        print(row)


def decode_rows(layers: int = 4) -> None:
    """One query row per item over its slots, K/V pools the size of computed's default ones
    (a fresh 16 MiB write between runs pushes them out of cache, as a step's other layers do)."""
    from computed import kernels

    native = kernels.paged_decode()
    num_slots = 8192 * BLOCK
    pools = [torch.randn(2, num_slots, KV_HEADS, DIM) for _ in range(layers)]
    evict = torch.zeros(4 * 1024 * 1024)

    def cold(fn) -> float:
        times = []
        for _ in range(11):
            evict.add_(1)
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return sorted(times)[5] * 1e3

    print(
        f"decode rows, {layers} layers, cold: gather + fold vs native paged decode ({kernels.error() or 'built'})"
    )
    for items, width_k in ((8, 1001), (64, 97), (64, 1100)):
        blocks = torch.randperm(8192)[: items * -(-width_k // BLOCK)].view(items, -1)
        slots = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK)).view(items, -1)[:, :width_k].contiguous()
        q = torch.randn(items, HEADS, DIM)

        row = (
            f"  {items} x 1 x {width_k}: gather + fold {cold(partial(_gather_fold, pools, q, slots)):.2f} ms"
        )
        if native is not None:
            run = partial(_native, native, pools, q, slots, torch.full((items,), width_k))
            row += f", native {cold(run):.2f} ms"
        print(row)


def _gather_fold(pools: list[torch.Tensor], q: torch.Tensor, slots: torch.Tensor) -> None:
    items, width_k = slots.shape
    for kv in pools:
        k, v = (
            c.view(c.shape[0], -1).index_select(0, slots.view(-1)).view(items, width_k, KV_HEADS, DIM)
            for c in kv
        )
        fold(q[:, None], k, v)


def _native(op, pools: list[torch.Tensor], q: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor) -> None:
    for kv in pools:
        op(q, kv[0], kv[1], slots, lens, DIM**-0.5)


def step() -> None:
    """Whole decode steps of the default model through `ModelRunner.run` (plan, forward,
    logits, greedy sampling): the modules' forward against `NativeForward` (the same ops
    without the modules' glue), interleaved, median of 15 each."""
    from computed.attention import SpanInput
    from computed.config import DEFAULT_MODEL_DIR
    from computed.kv_pool import KVPool
    from computed.model import load_model
    from computed.model_runner import ForwardInput, ModelRunner
    from computed.sequence import SamplingParams

    loaded = load_model(DEFAULT_MODEL_DIR, torch.device("cpu"), torch.float32)
    model, c = loaded.model, loaded.config
    if model.native is None:
        print("decode steps: the native forward did not build (no native kernels)")
        return
    pool = KVPool(c.num_layers, 8192, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, pool, BLOCK, torch.device("cpu"))
    blocks = torch.randperm(8192).tolist()

    def decode(rows: int, shared: int, private: int) -> ForwardInput:
        prefix, rest = blocks[: shared // BLOCK], blocks[shared // BLOCK :]
        per = -(-(private + 1) // BLOCK)
        spans = [SpanInput(prefix + rest[i * per : (i + 1) * per], shared + private, 1) for i in range(rows)]
        return ForwardInput(
            [5] * rows,
            spans,
            list(range(rows)),
            list(range(rows)),
            [SamplingParams()] * rows,
            list(range(rows)),
            rows,
        )

    native = model.native
    print("decode steps, ModelRunner.run: modules' forward vs NativeForward (ms)")
    for rows, shared, private in ((1, 0, 16), (8, 512, 600), (64, 1024, 96)):
        inp, times = decode(rows, shared, private), {"modules": [], "native": []}
        for _ in range(15):
            for name, forward in (("modules", None), ("native", native)):
                model.native = forward
                times[name].append(timed(partial(runner.run, inp), repeats=1))
        model.native = native
        mods, nat = (sorted(t)[7] for t in times.values())
        what = f"{rows} rows x ({shared} shared + {private + 1})"
        print(f"  {what:32} modules {mods:6.2f}, native {nat:6.2f}")


if __name__ == "__main__":
    main()
