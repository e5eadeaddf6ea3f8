"""Decode steps over static buffers at a ladder of batch sizes: CUDA graphs on CUDA.

A plain decode step (every sequence one new token, written) is replayed from a captured
`torch.cuda.CUDAGraph` per batch-size bucket (1, 2, 4, 8, 16, 32, ... max_num_seqs, as
nano-vllm captures), so its ~30 layers of small kernels cost one launch. Capture needs
every input at a fixed address and every shape fixed, so the step's inputs live in static
buffers and its attention plan is expressed in fixed-shape tensors derived on the device:

    host fills (rows 0..B-1, padding rows B..bucket-1 repeat row 0):
      input_ids (bucket,)               the fed token of each row
      context_lens (bucket,)            tokens visible after the step (the new one included)
      tables (bucket, max_blocks)       block ids; columns past a row's context are 0, never read
      write_rows (bucket,)              0..B-1, then 0 for every padding row
    the captured step derives (the plan, in fixed shapes):
      positions = context_lens - 1
      write_slots = tables[row, positions // block_size] * block_size + positions % block_size
      key_slots (bucket, key_width) = every slot of every table block; key_lens = context_lens
    then runs the model's forward over one decode tile (all rows, in order) and keeps the
    final hidden states; the host projects the B real rows to logits, outside the graph.

Padding rows are harmless by construction: a padding row is row 0 again (its token, its
context, its table) and its K/V write takes row 0's K/V (`write_rows`) to row 0's slot,
so it writes the bytes row 0 writes, where row 0 writes them, and reads only row 0's
blocks: it never touches a block that the step's own row 0 does not own. Its hidden
state is dropped. The key width is fixed per DecodeGraphs (`max_context`, whole blocks):
the kernels read `key_lens` keys per row, so a wider slot table costs its fill, not reads.

Everywhere but CUDA the same buffers and the same code run eagerly (no capture); the CPU
test drives that path against `ModelRunner`'s eager step bit for bit
(tests/computed/test_decode_graphs.py). A step outside the ladder (more rows than its top
bucket, a context past `max_context`, a prefill, a fully cached prompt) runs eager.

Capture writes K/V: the warm-up runs the step on zeroed buffers (row 0 writes token 0's
K/V into block 0, slot 0), so capture happens when the worker starts, before any block is
live (as `ModelRunner.measure_prefill_seconds_per_token` writes into unheld blocks).
Backends: the step needs attention kernels that take `key_lens` on the device and never
sync with the host (cuda_triton, cpu_native); torch_portable builds a key mask from host
lengths, so `supports` says no and the runner stays eager there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from computed.attention import AttentionBatch, SpanInput, Tile
from computed.kv_pool import KVPool

# The attention backends whose decode tile runs from device-side lengths, capture-safe.
STATIC_BACKENDS = ("cuda_triton", "cpu_native")


def batch_ladder(max_num_seqs: int) -> tuple[int, ...]:
    """nano-vllm's buckets: 1, 2, 4, 8, then every multiple of 16, up to `max_num_seqs`
    (itself the top bucket where it is none of those)."""
    ladder = [b for b in (1, 2, 4, 8) if b <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if ladder[-1] != max_num_seqs:
        ladder.append(max_num_seqs)
    return tuple(ladder)


class DecodeGraphs:
    """Static-buffer decode steps for `model` over `pool`; captured as CUDA graphs when
    `capture` (default: on CUDA). Use `run`, which answers None for a step it does not serve.

    Invariants: the static buffers are allocated once and only written in place (a graph
    reads them at their captured addresses); a bucket's rows past the step's are row 0's
    copies (see the module docstring); `hidden` rows of a step are valid until the next.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        block_size: int,
        max_num_seqs: int,
        max_context: int,
        capture: bool | None = None,
    ) -> None:
        assert block_size == pool.block_size, f"block size {block_size} for a pool of {pool.block_size}"
        assert max_num_seqs >= 1 and max_context >= 1, (max_num_seqs, max_context)
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.device = pool.device
        self.buckets = batch_ladder(max_num_seqs)
        self.max_blocks = -(-max_context // block_size)
        self.key_width = self.max_blocks * block_size
        self.max_context = min(max_context, model.rotary.max_positions)
        self.capture = self.device.type == "cuda" if capture is None else capture
        rows, device = self.buckets[-1], self.device
        dtype = model.model.embed_tokens.weight.dtype
        # Filled by the host each step (staged in host arrays of the same shapes): the head's
        # rows are the input ids, the context lens and the write rows.
        self._host_head = np.zeros((3, rows), dtype=np.int64)
        self._host_head[1] = 1  # a context of one token: the warm-up's
        self._host_tables = np.zeros((rows, self.max_blocks), dtype=np.int64)
        # Per row: the block table list its host row holds, and how many of its blocks.
        self._filled: list[tuple[Sequence[int] | None, int]] = [(None, 0)] * rows
        self._head = torch.from_numpy(self._host_head).to(device, copy=True)
        self.input_ids, self.context_lens, self.write_rows = self._head.unbind(0)  # (rows,) views
        self.tables = torch.zeros(rows, self.max_blocks, dtype=torch.int64, device=device)
        # Derived on the device by the step (the plan in fixed shapes), and its output.
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.write_slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.key_slots = torch.zeros(rows, self.key_width, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(rows, model.config.hidden_size, dtype=dtype, device=device)
        self._offsets = torch.arange(block_size, dtype=torch.int64, device=device)
        self._batches = {bucket: self._batch(bucket) for bucket in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.capture:
            self._capture_all()

    @staticmethod
    def supports(backend_name: str | None) -> bool:
        return backend_name in STATIC_BACKENDS

    def bucket_for(self, spans: Sequence[SpanInput]) -> int | None:
        """The bucket that serves a step of `spans`, or None (eager): every span a decode row
        that writes its token, at most the top bucket's rows, contexts within `max_context`."""
        if not spans or len(spans) > self.buckets[-1]:
            return None
        for span in spans:
            if span.num_new_tokens != 1 or span.write_kv is not True:
                return None
            if span.num_computed_tokens + 1 > self.max_context:
                return None
        return next(b for b in self.buckets if b >= len(spans))

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], spans: Sequence[SpanInput]) -> torch.Tensor | None:
        """The final hidden states (B, hidden) of a decode step of `spans` feeding
        `token_ids`, its K/V written into the pool; None where this step runs eager. The
        answer is a view of the static output, valid until the next step."""
        bucket = self.bucket_for(spans)
        if bucket is None:
            return None
        self._fill(bucket, token_ids, spans)
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._step(bucket)
        return self.hidden[: len(spans)]

    def _fill(self, bucket: int, token_ids: Sequence[int], spans: Sequence[SpanInput]) -> None:
        """The step's inputs into the static buffers' first `bucket` rows; the padding rows
        repeat row 0 (module docstring). Staged in persistent host arrays, then two copies
        (the head, the tables' rows). A row's table is written only where it changed: a
        decode burst's next step (`ForwardInput.next_decode`) keeps each row's block table
        list, so a row then writes at most the one block it enters; a table's columns past
        its row's blocks keep older ids, never read (the kernels read `key_lens` keys).
        Why: filling every row's whole table cost 1.6 ms a step for 256 rows of 70 blocks.
        Invariant this relies on: a block table list, once in a step, only ever grows."""
        num_rows, bs = len(spans), self.block_size
        contexts = np.fromiter((s.num_computed_tokens + 1 for s in spans), dtype=np.int64, count=num_rows)
        tables, head, filled = self._host_tables, self._host_head, self._filled
        num_blocks = -(-contexts // bs)
        fresh: list[int] = []  # rows whose table is another list than their host row's
        for i, (span, blocks) in enumerate(zip(spans, num_blocks.tolist())):
            known, done = filled[i]
            if span.block_table is not known:
                fresh.append(i)
            elif done < blocks:  # the same list, a block further (a burst's next step)
                self._write_blocks(i, span.block_table, done, blocks)
        if fresh:
            self._write_rows(fresh, [spans[i].block_table for i in fresh], num_blocks[fresh])
        if num_rows < bucket:
            tables[num_rows:bucket] = tables[0]
            filled[num_rows:bucket] = [(None, 0)] * (bucket - num_rows)  # rewritten: not a row's own
        head[0, :num_rows], head[0, num_rows:bucket] = token_ids, token_ids[0]  # input ids
        head[1, :num_rows], head[1, num_rows:bucket] = contexts, contexts[0]  # context lens
        head[2, :num_rows], head[2, num_rows:bucket] = np.arange(num_rows), 0  # write rows
        last = tables[np.arange(num_rows), (contexts - 1) // bs] * bs + (contexts - 1) % bs
        if len(np.unique(last)) != num_rows:
            raise ValueError("two new tokens of the batch write the same pool slot")
        # Pageable sources: each copy has staged its bytes when it returns, so the next
        # step may refill the host arrays whatever the device still has queued.
        self._head.copy_(torch.from_numpy(head), non_blocking=True)
        self.tables[:bucket].copy_(torch.from_numpy(tables[:bucket]), non_blocking=True)

    def _write_blocks(self, row: int, table: Sequence[int], done: int, blocks: int) -> None:
        """Blocks `done .. blocks - 1` of `table` into host row `row`."""
        if len(table) < blocks:
            raise ValueError(f"span {row}: block table of {len(table)} blocks cannot hold its token")
        new = table[done:blocks]
        if min(new) < 0:
            raise ValueError(f"negative block id in {list(new)[:8]}")
        self._host_tables[row, done:blocks] = new
        self._filled[row] = (table, blocks)

    def _write_rows(self, rows: list[int], lists: list[Sequence[int]], num_blocks: np.ndarray) -> None:
        """Each of `rows`' first `num_blocks` blocks from its list, all at once (one fill
        from the lists concatenated, as `AttentionBatch.build` fills its tables)."""
        table_lens = np.fromiter((len(t) for t in lists), dtype=np.int64, count=len(lists))
        short = np.flatnonzero(table_lens < num_blocks)
        if len(short):
            i = int(short[0])
            raise ValueError(f"span {rows[i]}: block table of {table_lens[i]} blocks cannot hold its token")
        listed = np.fromiter(
            itertools.chain.from_iterable(lists), dtype=np.int64, count=int(table_lens.sum())
        )
        columns = np.arange(int(num_blocks.max()))
        inside = columns[None, :] < num_blocks[:, None]  # (R, needed) the blocks each row reads
        picked = listed[((np.cumsum(table_lens) - table_lens)[:, None] + columns[None, :])[inside]]
        if picked.min() < 0:
            raise ValueError(f"negative block id in {picked[picked < 0][:8].tolist()}")
        index = np.asarray(rows)
        part = self._host_tables[index, : len(columns)]  # (R, needed), a copy: written back
        part[inside] = picked
        self._host_tables[index, : len(columns)] = part
        for row, table, blocks in zip(rows, lists, num_blocks.tolist()):
            self._filled[row] = (table, blocks)

    def _step(self, bucket: int) -> None:
        """The captured work: the plan from the static inputs, the forward, the output copy
        (fixed shapes, no host sync)."""
        bs = self.block_size
        lens, tables = self.context_lens[:bucket], self.tables[:bucket]  # (b,), (b, max_blocks)
        positions = torch.sub(lens, 1, out=self.positions[:bucket])  # (b,)
        blocks = tables.gather(1, (positions // bs)[:, None])[:, 0]  # (b,) the block each row writes
        torch.add(blocks * bs, positions % bs, out=self.write_slots[:bucket])
        torch.add(
            tables[:, :, None] * bs,
            self._offsets,
            out=self.key_slots[:bucket].view(bucket, self.max_blocks, bs),
        )  # (b, max_blocks, bs): every slot of every table block
        hidden = self.model(self.input_ids[:bucket], self._batches[bucket], self.pool)  # (b, hidden)
        self.hidden[:bucket].copy_(hidden)

    def _batch(self, bucket: int) -> AttentionBatch:
        """The bucket's `AttentionBatch`: views of the static buffers, one decode tile of
        every row in order, no merge (built once; the step rewrites the views' contents)."""
        rows = torch.arange(bucket, dtype=torch.int64, device=self.device)
        tile = Tile(
            query_rows=rows.view(bucket, 1),
            key_slots=self.key_slots[:bucket].view(-1),
            key_lens=self.context_lens[:bucket],
            causal=False,
            valid=rows,
            valid_rows=rows,
            num_items=bucket,
            num_queries=1,
            num_keys=self.key_width,
            # No host lengths (they change under the graph): a full width means no key mask,
            # which only torch_portable would build (`supports` keeps it eager).
            host_key_lens=np.full(bucket, self.key_width, dtype=np.int64),
            in_order=True,
        )
        return AttentionBatch(
            block_size=self.block_size,
            positions=self.positions[:bucket],
            write_slots=self.write_slots[:bucket],
            write_token_index=self.write_rows[:bucket],
            query_starts=np.arange(bucket, dtype=np.int64),
            query_lens=np.ones(bucket, dtype=np.int64),
            context_lens=np.full(bucket, self.key_width, dtype=np.int64),
            tables=np.zeros((bucket, self.max_blocks), dtype=np.int64),
            last_token_index=rows,
            # The rotary table covers every position a served step may hold.
            max_position=min(self.key_width, self.model.rotary.max_positions) - 1,
            tiles=(tile,),
            write_rows_selected=True,
        )

    def _capture_all(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool (nano-vllm's order:
        the largest step's allocations serve every smaller one). Each bucket runs once
        eagerly on a side stream first (kernel compiles, lazy allocations, the rotary
        table), as torch's capture recipe says."""
        # The rotary table at its full length first: an eager step that grew it later would
        # free the table the graphs read (they hold its address, not a reference).
        rotary = self.model.rotary
        rotary.cos_sin(self.positions[:1], rotary.max_positions - 1, self.hidden.dtype)
        memory_pool = None
        side = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    self._step(bucket)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=memory_pool):
                    self._step(bucket)
                if memory_pool is None:
                    memory_pool = graph.pool()
                self._graphs[bucket] = graph
            torch.cuda.synchronize(self.device)
