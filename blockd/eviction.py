"""Eviction: which unreferenced cached block goes first.

Only *leaves* are candidates: cached, unreferenced, with no cached child. Evicting a
leaf can turn its parent into a leaf, which then joins the heap, so a chain is
eaten tail first and no cached block is ever left without its parent.

A policy is a small object: `priority(block)` (the smallest priority is evicted
first), computed once when the leaf enters the heap; `evicted(priority)`, told
the priority of each block the heap gives up (aging policies keep their clock
there); and `returned(num_uses)`, told when a hash the pool's ghost table remembers
is committed again (blockd.ghosts), with the uses it had when it left. Policies come
from `POLICIES` by name; each pool has its own instance.

Every policy here is O(1) per priority, so push and pop stay O(log n). None of them
acts without pressure: the pool asks for a victim only when it has no free block.

Retention priority (`Block.retention`, 1..100, TensorRT-LLM's scale; 0 = unset =
`DEFAULT_RETENTION`) is weighed by every policy: `lru` ranks by it first, as
TensorRT-LLM does; `lfu` and `lfuda` scale a block's value by retention ÷ default;
`adaptive-ungated` (and `adaptive`, the gate over it) lengthens (or shortens) a block's
life by log2(retention ÷ default) horizons.

The default, `adaptive`, is `adaptive-ungated` behind an admission gate (GatedPolicy):
blocks whose key the pool has not seen before (blockd.admission's key memory, via the
ghost table) are on probation and go first, as strictly as the ghost returns say pays;
within the inner policy, one-use blocks live shorter or longer by the length of the run
they were computed in (`Block.run_length`: long fresh runs are scans and pasted one-shot
documents), as their run class's ghost returns against the other one-use blocks' say.

`adaptive-sim` (SimulatedPolicy, opt-in) is `adaptive` following whichever of adaptive,
lfu, lru+seen2 and lfuda miniature simulations on a sample of the pool's block hashes
say hits most (blockd.minisim); ~2.3x blockd's CPU per admission under
bench.blockd_inprocess, so not the default.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from itertools import count
from typing import Any, ClassVar, Protocol

from mypy_extensions import mypyc_attr

from blockd.block import Block, Ranked
from blockd.minisim import PolicyChooser

# Compared element by element; each policy picks its shape (ticks and counts are ints).
Priority = tuple[Any, ...]

DEFAULT_RETENTION = 35  # TensorRT-LLM's default KV retention priority
MAX_RETENTION = 100


def retention_weight(block: Ranked) -> float:
    """The block's retention priority relative to the default: 1.0 when unset."""
    return (block.retention or DEFAULT_RETENTION) / DEFAULT_RETENTION


class EvictionPolicy(Protocol):
    """Ranks evictable leaves: the smallest priority goes first.

    `priority` may read only the block's `last_tick`, `num_seen`, `num_hits`,
    `retention` and `run_length`, besides the policy's own state: a parent released with
    its child (all five equal) takes the child's priority when eviction reaches it
    (`BlockPool._drop_chain`). `evicted` is told each victim's priority, `returned` each
    ghost that came back (its remembered uses and run length)."""

    @property
    def name(self) -> str:
        """The registry name (`POLICIES`), `SEEN_TWICE` appended for that rule."""
        ...

    def priority(self, block: Ranked) -> Priority: ...

    def evicted(self, priority: Priority) -> None: ...

    def evicted_many(self, priority: Priority, num: int) -> None:
        """`num` victims of one priority (a chain's blocks that inherited its tail's,
        `BlockPool._drop_chain`): exactly `evicted(priority)` called `num` times, state
        for state and bit for bit (float counters included), so a pool's decisions do not
        depend on which it calls; `num` >= 0, 0 changes nothing. Cheaper: one call per
        chain instead of one per block (bench.blockd_inprocess)."""
        ...

    def returned(self, num_uses: int, run_length: int = 0) -> None: ...


@mypyc_attr(allow_interpreted_subclasses=True)  # a user's policy may extend one (blockd.native)
class LruPolicy:
    """Least recently released first, lower retention priority before higher (a
    strict class order, as TensorRT-LLM's priority-based eviction). A release stamps
    one tick on the sequence's whole chain, so a parent is never newer than its
    children."""

    name: ClassVar[str] = "lru"

    def priority(self, block: Ranked) -> Priority:
        if block.retention:
            return (block.retention, block.last_tick)
        return (DEFAULT_RETENTION, block.last_tick)

    def evicted(self, priority: Priority) -> None:
        pass

    def evicted_many(self, priority: Priority, num: int) -> None:
        pass

    def returned(self, num_uses: int, run_length: int = 0) -> None:
        pass


@mypyc_attr(allow_interpreted_subclasses=True)  # a user's policy may extend one (blockd.native)
class LfuPolicy:
    """Fewest verified hits first (scaled by retention), least recently released among
    equals. No aging: a block hot long ago outlives a block hot now."""

    name: ClassVar[str] = "lfu"

    def priority(self, block: Ranked) -> Priority:
        if block.retention:
            # uses (hits + the commit) scaled, on the scale of hits
            return ((block.num_hits + 1) * retention_weight(block) - 1, block.last_tick)
        return (block.num_hits, block.last_tick)

    def evicted(self, priority: Priority) -> None:
        pass

    def evicted_many(self, priority: Priority, num: int) -> None:
        pass

    def returned(self, num_uses: int, run_length: int = 0) -> None:
        pass


@mypyc_attr(allow_interpreted_subclasses=True)  # a user's policy may extend one (blockd.native)
class LfuDaPolicy:
    """LFU with dynamic aging (Arlitt et al., LFU-DA; GDSF with equal sizes and costs):
    a block's value is `age + uses × weight`, where `age` is the value of the last
    block evicted and `uses` its verified hits plus the commit that made it (plus the
    uses the ghost table remembers from before an eviction, `Block.num_seen`). Every
    block that enters the heap later starts from a higher `age`, so frequency earned
    long ago is worth less than frequency earned now: hot families stay, stale ones
    age out, and one-off blocks (one use) go first. Ties: least recently released.

    `age` only grows (it is the value of a victim, and every value in the heap is at
    least the age it was computed with), so priorities of old entries stay comparable
    with new ones: O(1) per priority, no re-keying."""

    name: ClassVar[str] = "lfuda"

    def __init__(self) -> None:
        self.age = 0.0

    def priority(self, block: Ranked) -> Priority:
        uses = block.num_seen + block.num_hits
        if block.retention:
            return (self.age + uses * retention_weight(block), block.last_tick)
        return (self.age + uses, block.last_tick)

    def evicted(self, priority: Priority) -> None:
        self.age = max(self.age, priority[0])

    def evicted_many(self, priority: Priority, num: int) -> None:
        # `age` is a max: telling it one priority again changes nothing
        if num > 0:
            self.evicted(priority)

    def returned(self, num_uses: int, run_length: int = 0) -> None:
        pass


@mypyc_attr(allow_interpreted_subclasses=True)  # a user's policy may extend one (blockd.native)
class AdaptivePolicy:
    """LRU, plus a frequency bonus only where frequency has been seen to predict reuse.

    A block's priority is `last_tick + unit × bonus[class]`: least recently
    released first, except that a block of a use class (1, 2, 3, 4, 5+ uses: commits
    and hits, ghost-remembered ones included) whose evicted blocks have come back more
    often than one-use blocks, `ratio` times as often, lives `ratio / 2^MARGIN - 1`
    horizons longer (0 to MAX_BONUS: linear in the ratio, as GatedPolicy's penalty).
    Return rates are learned from the ghost table (ARC's and S3-FIFO's signal): per
    class, evictions (`evicted`) against ghost hits (`returned`), decayed so the
    policy follows a changing workload. `horizon` is how long a one-use block survives
    (an average of now - last_tick of one-use victims, in release ticks); `unit`, what a
    horizon of bonus is worth, is the horizon but at least MIN_UNIT ticks.

    Measured (bench.eviction_quality): on chats, where a block's next use does not
    depend on how often it was used, every class returns at the same rate, no bonus
    is earned and the policy is LRU (which is near optimal there); under Zipf
    popularity or one-off floods, hot prefixes return far more often than one-use
    suffixes, and earn lives long enough to survive between their uses (LFU's gain).
    Until evictions have taught it otherwise (a prior of equal rates), it is LRU.

    Why linear (bench.eviction_quality, the default ÷ the best other shipped policy): a
    class that returns R times as often as one-use blocks is reused ~R times sooner, so
    it is worth keeping ~R times as long, not log2(R) horizons. With the previous rule,
    log2(ratio) - 0.5 capped at 8, hot families died between their uses where LFU (no
    aging) keeps them: one-off 2% 0.979 and 5% 0.965 of lfu, zipf 10% 0.978, few-shot 10%
    0.978. Linear, MARGIN 0.25, cap 64: 0.992, 0.981, 0.985, 0.981; conversation at 2%
    1.364x -> 1.370x lru, worst ÷ lru 0.988 -> 0.991 (conversation 25%); zipf 2% 0.985 ->
    0.980 of lfu. Linear with cap 8: one-off 2% 0.948 (the cap binds); cap 32: one-off 5%
    0.970; MARGIN 0.5: few-shot 10% 0.973 (0.3: 0.964, 0.375: 0.975; that cell swings with
    the margin), MIN_UNIT 64: conversation 2% 1.33x.

    Run-length classes: a one-use block also belongs to a run class, the log2 bucket of
    `Block.run_length` (the uncached blocks its sequence brought at admission: 0 unknown,
    1, 2-3, ..., 64+), learned the same way from one-use victims and their returns (the
    ghost table carries the run length), each class against the *rest* of the one-use
    victims. A class whose victims return less often than the rest's, by more than
    RUN_MARGIN, lives `log2(ratio) - RUN_MARGIN` horizons shorter (capped at MAX_RUN_PENALTY);
    one whose victims return more often, by more than RUN_BONUS_MARGIN, lives up to
    RUN_MAX_BONUS horizons longer. On the conversation trace the long fresh runs are
    pasted one-shot documents, never used again, while a conversation's opening, reused
    by its next turn, is a shorter run.

    Measured (bench.eviction_quality, 7 traces x 4 pools, cells via bench.directory_replay):
    - against the average of all one-use victims and aging only (the previous rule), the
      conversation trace at 2% reached 1.12x lru: the 64+ class is most of the one-use
      victims there, so it is never far from the average it dominates (returns 1/4 as
      often as the rest, 1/2 as often as the average) and earned ~0.8 horizons of aging;
    - against the rest, aging only: 1.13x (forcing the 64+ class out first, 8 or 64
      horizons: 1.13x, the ceiling of aging alone);
    - against the rest, with the bonus (RUN_BONUS_MARGIN 0.25, RUN_MAX_BONUS 2): 1.36x
      (5%: 1.06x -> 1.13x), every cell >= 0.98x lru (worst 0.988, conversation 25%;
      was 0.994), worst of the best other policy 0.953 -> 0.955 (long-conversation 5%,
      lru+seen2). A bonus capped at 8 horizons: 1.38x but 0.947 on long-conversation 5%
      and few-shot 10% 0.95 of lfu; at 1: 1.37x, 0.950; RUN_BONUS_MARGIN 0.5: 1.36x,
      0.946.
    - not adopted, a run class of its own for continuations (a sequence whose hits end at
      a cached leaf, an earlier sequence's end: a conversation's next turn), learned as
      the others: conversation 2% 1.370x -> 1.383x lru, but long-conversation 25% 0.965x
      and chat 10% 0.979x, below the 0.98 floor; aged by a fixed 1-8 horizons instead,
      1.316-1.323x at 2%.

    O(1) per priority and per event, whatever the number of classes: the decayed
    counters are kept in inflated units (an event adds `scale` = DECAY^-n after n
    evictions, so no counter is multiplied per eviction; they are scaled back once
    `scale` passes RENORMALISE, every ~4.6M evictions), and the bonus table is
    recomputed at most once per REFRESH evictions or after a return, when next read.
    Entries already in the heap keep the bonus they were pushed with: they are
    comparable with new ones because both are times."""

    name: ClassVar[str] = "adaptive-ungated"
    NUM_CLASSES: ClassVar[int] = 5  # uses 1, 2, 3, 4, 5+
    NUM_RUNS: ClassVar[int] = 8  # run-length classes of one-use blocks: 0 (unknown), 1, 2-3, 4-7, ..., 64+
    # log2 ratio by which a run class's one-use victims must return less often than the
    # other one-use victims before it is aged, and more often before it earns a bonus (capped
    # at RUN_MAX_BONUS horizons): measured in the class docstring.
    RUN_MARGIN: ClassVar[float] = 1.0
    RUN_BONUS_MARGIN: ClassVar[float] = 0.25
    RUN_MAX_BONUS: ClassVar[float] = 2.0
    DECAY: ClassVar[float] = 1 - 1 / 20_000  # per eviction: the rates reflect the last ~20k evictions
    PRIOR: ClassVar[float] = 20.0  # pseudo-evictions per class at the one-use return rate
    MARGIN: ClassVar[float] = 0.25  # log2 ratio a class must pass before it earns a bonus (noise)
    MAX_BONUS: ClassVar[float] = 64.0  # horizons, for a use class (as GatedPolicy.MAX_PENALTY)
    # Horizons a run class is aged by, at most: the use classes' cap before it rose to 64
    # (the run-class measurements above were made with 8).
    MAX_RUN_PENALTY: ClassVar[float] = 8.0
    HORIZON_WINDOW: ClassVar[int] = 64  # one-use victims averaged into `horizon`
    MIN_HORIZON: ClassVar[float] = 16.0  # ticks: the unit of retention priority before a horizon is known
    # Ticks: the least one horizon of frequency bonus is worth. In a small pool one-use
    # victims die within a release or two (few-shot at 2%: a horizon of 0.4 ticks), so a
    # bonus of a few horizons protected a hot block for less than one release and
    # frequency never paid where LFU gains most. Floored at 128, the default rose from
    # 0.86 to 0.99 of the best other shipped policy on zipf at 2% and from 0.88 to 1.04 on
    # few-shot at 2% (64: 0.98 and 1.04), and kept >= 0.98x lru everywhere; 256 cost the
    # conversation trace at 5% 4% of lru's hits, 1024 21% (bench.eviction_quality).
    MIN_UNIT: ClassVar[float] = 128.0
    # Evictions between recomputations of the bonus table when no block returns. Without
    # returns the table only drifts down (a class's rate loses at most REFRESH of its
    # >= PRIOR evictions' weight), and the next return recomputes it at once. Recomputed at
    # every eviction instead, the table took ~13% of blockd's time under
    # `python -m bench.blockd_grpc` (py-spy; an admission there evicts a 128-block chain,
    # and `takes_next` reads the table between evictions).
    REFRESH: ClassVar[int] = 64
    RENORMALISE: ClassVar[float] = 1e100

    def __init__(self, rate: float = 1.0) -> None:
        """`rate` > 1: the policy sees 1/`rate` of a pool's evictions (a miniature
        simulation's, `_make_candidate`), so its window, prior and refresh span as many of
        them and the same traffic."""
        self.now = 0  # the latest release tick seen
        self.horizon = 0.0
        self.decay = self.DECAY if rate <= 1 else 1 - min(0.5, (1 - self.DECAY) * rate)
        self.prior = self.PRIOR / max(1.0, rate)
        self.horizon_window = max(1, round(self.HORIZON_WINDOW / max(1.0, rate)))
        self.refresh = max(1, round(self.REFRESH / max(1.0, rate)))
        self._scale = 1.0  # DECAY^-n: the weight of an event now, in the counters' units
        self._grow = 1 / self.decay
        self._evictions = [0.0] * self.NUM_CLASSES  # inflated by `_scale`
        self._returns = [0.0] * self.NUM_CLASSES
        self._bonus = [0.0] * self.NUM_CLASSES
        # one-use victims and returns per run-length class (Block.run_length), and the
        # horizons of life (negative: shorter) each class earns
        self._run_evictions = [0.0] * self.NUM_RUNS
        self._run_returns = [0.0] * self.NUM_RUNS
        self._run_bonus = [0.0] * self.NUM_RUNS
        self._since = 0  # evictions since the table was computed
        self._stale = False  # a return since, or REFRESH evictions

    @property
    def evictions(self) -> list[float]:
        """Decayed evictions per use class (1, 2, 3, 4, 5+ uses)."""
        return [e / self._scale for e in self._evictions]

    @property
    def returns(self) -> list[float]:
        """Decayed ghost returns per use class."""
        return [r / self._scale for r in self._returns]

    @property
    def bonus(self) -> list[float]:
        """Horizons of extra life per use class (1, 2, 3, 4, 5+ uses)."""
        if self._stale:
            self._update()
        return self._bonus

    def priority(self, block: Ranked) -> Priority:
        uses = block.num_seen + block.num_hits
        tick = block.last_tick
        self.now = max(self.now, tick)
        if self._stale:
            self._update()
        if uses < 2:
            run = min(self.NUM_RUNS - 1, block.run_length.bit_length())
            bonus = self._bonus[0] + self._run_bonus[run]
        else:
            run = 0
            bonus = self._bonus[min(5, uses) - 1]
        value = tick + max(self.horizon, self.MIN_UNIT) * bonus
        if block.retention:  # before the first evictions there is no horizon: a floor
            value += max(self.horizon, self.MIN_HORIZON) * math.log2(retention_weight(block))
        return (value, tick, uses, run)

    def evicted(self, priority: Priority) -> None:
        _, tick, uses, run = priority
        scale = self._scale = self._scale * self._grow
        if uses < 2:
            self._run_evictions[run] += scale
            self._evictions[0] += scale
            self.horizon += (self.now - tick - self.horizon) / self.horizon_window
        else:
            self._evictions[min(5, uses) - 1] += scale
        if scale > self.RENORMALISE:
            self._renormalise()
        self._since += 1
        if self._since >= self.refresh:
            self._stale = True

    def evicted_many(self, priority: Priority, num: int) -> None:
        # The decayed counters and `horizon` are floats: a closed form (scale x grow^num, a
        # geometric sum) would round differently from `num` calls and could order two
        # priorities differently, so the same float operations run in the same order, in
        # one loop over locals. What depends only on the count (`_since`, hence `_stale`)
        # is advanced at once: the table is recomputed when next read, never in `evicted`.
        assert num >= 0, f"a negative number of victims: {num}"
        if not num:
            return
        scale, grow = self._scale, self._grow
        if _may_pass(scale, grow, num, self.RENORMALISE):  # every ~4.6M evictions
            for _ in range(num):
                self.evicted(priority)  # renormalises where one eviction passes the limit
            return
        _, tick, uses, run = priority
        evictions = self._evictions
        if uses < 2:
            run_evictions = self._run_evictions
            total, in_run = evictions[0], run_evictions[run]
            # float(): `tick` comes from the untyped priority tuple, and an untyped `age`
            # made each pass of the loop generic object arithmetic in the compiled core (~5% of
            # an admission's instructions, callgrind); int - float converts the same way
            horizon, window, age = self.horizon, self.horizon_window, float(self.now - tick)
            for _ in range(num):  # `now` moves only in `priority`
                scale *= grow
                in_run += scale
                total += scale
                horizon += (age - horizon) / window
            evictions[0], run_evictions[run], self.horizon = total, in_run, horizon
        else:
            cls = min(5, uses) - 1
            scale, evictions[cls] = _decayed_sum(scale, grow, evictions[cls], num)
        self._scale = scale
        self._since += num
        if self._since >= self.refresh:
            self._stale = True

    def returned(self, num_uses: int, run_length: int = 0) -> None:
        self._returns[min(num_uses, self.NUM_CLASSES) - 1] += self._scale
        if num_uses < 2:
            self._run_returns[min(self.NUM_RUNS - 1, run_length.bit_length())] += self._scale
        self._stale = True

    def _renormalise(self) -> None:
        scale = self._scale
        self._evictions = [e / scale for e in self._evictions]
        self._returns = [r / scale for r in self._returns]
        self._run_evictions = [e / scale for e in self._run_evictions]
        self._run_returns = [r / scale for r in self._run_returns]
        self._scale = 1.0

    def _update(self) -> None:
        # Each class's rate is shrunk toward the one-use rate by PRIOR pseudo-evictions,
        # so a class with few evictions (little evidence) earns no bonus: measured,
        # this keeps the chat trace at lru's hit rate where a prior of 1/2 lost 2%.
        # In inflated units: PRIOR and the +1/+2 of the one-use rate scale with `scale`.
        scale = self._scale
        returns, evictions = self._returns, self._evictions
        base = (returns[0] + scale) / (evictions[0] + 2 * scale)
        prior, margin, cap = self.prior * scale, self.MARGIN, self.MAX_BONUS
        # Linear in the return ratio, as the gate: a class returning `ratio` times as often
        # as one-use blocks lives `ratio / 2^MARGIN - 1` horizons longer (the class docstring's
        # measurements); log2(ratio) - MARGIN, the previous rule, gave hot families too
        # short a life where a stationary popularity makes LFU near optimal.
        lin = 2.0**margin
        self._bonus = [
            min(cap, max(0.0, (r + prior * base) / (e + prior) / base / lin - 1))
            for r, e in zip(returns, evictions)
        ]
        # Run classes: each against the rest of the one-use victims (a class that is most of
        # them cannot be far from their average), shrunk toward the rest's rate.
        run_returns, run_evictions = self._run_returns, self._run_evictions
        all_returns, all_evictions = sum(run_returns), sum(run_evictions)
        run_bonus = []
        for r, e in zip(run_returns, run_evictions):
            rest = (all_returns - r + scale) / (all_evictions - e + 2 * scale)
            ratio = math.log2((r + prior * rest) / (e + prior) / rest)
            if ratio < -self.RUN_MARGIN:
                run_bonus.append(max(-self.MAX_RUN_PENALTY, ratio + self.RUN_MARGIN))
            elif ratio > self.RUN_BONUS_MARGIN:
                run_bonus.append(min(self.RUN_MAX_BONUS, ratio - self.RUN_BONUS_MARGIN))
            else:
                run_bonus.append(0.0)
        self._run_bonus = run_bonus
        self._since = 0
        self._stale = False


@mypyc_attr(allow_interpreted_subclasses=True)  # a user's policy may extend one (blockd.native)
class GatedPolicy:
    """The default: `AdaptivePolicy` behind an admission gate whose strictness adapts.

    A block is *admitted* once its key has been seen before: a hit in this life, or a
    commit whose hash the pool's ghost table or its long key memory (blockd.admission,
    8x the pool by default) still knows (`Block.num_seen` > 1). A block not admitted is
    on probation: it stays cached (findable, hit like any other) but ranks `penalty`
    release ticks older than it is, so under pressure it goes before admitted blocks
    released up to `penalty` ticks earlier. The gate decides only what stays cached
    after release: a live sequence's blocks are referenced and never evicted, and
    without pressure nothing is evicted at all.

    Strictness follows what the ghost table's returns (a hash evicted recently, within
    2x the pool, committed again) say about each side, as the inner policy's bonus does
    for use classes: per side (probation, admitted), decayed victims and returns give a
    return rate, shrunk toward the pool's overall rate by PRIOR pseudo-victims; the
    gate is `ratio / 2^MARGIN - 1` horizons of the inner policy (0 to MAX_PENALTY), where
    `ratio` is the admitted side's rate over the probation side's. Where one-offs
    dominate, their victims never return and the gate closes (they go first); where
    probation victims come back about as often as admitted ones (conversations whose
    next turn comes after long think times, everything reused), it stays open (0: the
    inner policy alone). It starts open and moves only once the pool has had
    MIN_EVIDENCE evictions.

    Measured (bench.eviction_quality): the first gate moved by ARC's steps (up on an
    admitted victim's return, down on a probation victim's, scaled by the victims'
    ratio); with the two sides' rates close, as on the conversation trace, that walk
    drifted to a closed gate and cost 3-6% of lru's hits at pools of 5-25%. Set from the
    rates, the gate stays open there (>= 0.98x lru on every trace and pool) and closes
    as far as before on Zipf and one-off traffic.

    What no gate can do there (bench.eviction_quality's conversation trace, pool 2%):
    evicting first exactly the blocks never used again reaches the optimum (0.29 hit
    rate against lru's 0.12), but most reuse is a conversation's second turn, whose
    blocks were seen once, like a one-shot's: admission on a key seen before, with an
    unbounded memory, gains 1% over lru; the best rule on what a pool could record
    (the length of the run a block was computed in: long fresh runs are one-shots) 1.35x
    in a standalone simulation, and the inner policy's run classes, learned from ghost
    returns against the other one-use blocks, 1.36x; one-shot requests sent with cache_policy READ_ONLY by a client that
    knows, 1.42x.

    Where a closed gate wins and the rates cannot tell (long-conversation, pools 2-10%:
    lru+seen2 1.05x lru at 5%, the default 1.01x; a gate fixed at 4-16 horizons 1.04x,
    but 0.79-0.85x on the conversation trace at 5% and 0.89-0.92x on long-conversation at
    25%): its reuse gaps are longer than the pool, so what pays is giving *some* blocks a
    life longer than the gap, not choosing better victims. Measured with an exact record
    of every victim (bench.eviction_quality's replay), probation and admitted victims
    return at the same rate there within any window (0.5 to 8 pools after eviction, and
    for good), open gate or closed; the sides differ only on traces where closing loses.
    Tried and dropped: an ARC-like integral controller on the two rates (setpoints 0.87
    to 1.23: long-conversation 5% 0.95-0.99 of lru+seen2, but conversation 10-25% 0.93-0.97x
    lru), and closing on rates over the key memory's window (probation and admitted
    victims kept apart) where most returns come after two pools (long-conversation 5%
    0.975 of lru+seen2, conversation 2% 1.36x -> 1.17x lru: the state it creates moves
    the rates). Telling it needs the hit rate each setting would have (a miniature
    simulation of each on sampled keys), which needs every hit, not only releases.

    What does tell it: how many victims come back at all. Where more than THRASH (1/4) of
    all victims return within the ghost table's window (2 pools), the pool thrashes: reuse
    gaps are a little longer than the pool, LRU keeps every block just short of its next
    use, and only a stable subset living longer than the gap hits (seen-twice's gain).
    There, if admitted victims return even slightly more often (THRASH_RATIO 1.05), the gate
    closes fully (THRASH_GATE). Measured (bench.eviction_quality, 7 traces x 4 pools): the
    default ÷ lru+seen2 on long-conversation 5% 0.955 -> 0.981 and 10% 0.977 -> 0.988
    (return rates there 0.34 and 0.44 of victims, admitted ÷ probation 1.14-1.16); zipf 10%
    0.985 -> 0.988 and few-shot 10% 0.981 -> 0.986 of lfu; no cell moved below its goals.
    The conversation trace returns 0.01-0.09 of its victims and chat 2% (0.59) returns
    probation victims more often: both stay open. THRASH 0.2 (gate 32) cost
    long-conversation 25% 1% of lru's hits; 0.3, or a gate of 16, reached 0.973-0.977 on
    long-conversation 5%; THRASH_RATIO 1.0, 0.974.

    O(1) per priority and per event, like the inner policy (counters in inflated units,
    the gate recomputed after a return or every REFRESH evictions, when next read); heap
    entries keep the penalty they were pushed with (comparable: both are times)."""

    name: ClassVar[str] = "adaptive"
    MAX_PENALTY: ClassVar[float] = 64.0  # horizons (of the inner policy): a fully closed gate
    MARGIN: ClassVar[float] = (
        1.0  # log2: admitted victims must return 2x as often as probation ones to close it
    )
    # Open at first: LRU-like (with the frequency bonus) until returns say otherwise. A gate
    # that starts half closed lost 3% to lru on the conversation trace at 25% (bench.eviction_quality),
    # where too few evictions happen to open it again.
    INITIAL_GATE: ClassVar[float] = 0.0
    MIN_EVIDENCE: ClassVar[int] = 20  # evictions before the gate moves (fewer: the rates are noise)
    DECAY: ClassVar[float] = 1 - 1 / 20_000  # victims and returns counted per side: the last ~20k evictions
    # Thrashing: where more than THRASH of all victims come back within the ghost table's
    # window (reuse gaps longer than the pool, as long-conversation's at 5-10%) and admitted
    # victims return at least THRASH_RATIO times as often as probation ones, the gate closes
    # to THRASH_GATE horizons (the class docstring's measurements).
    THRASH: ClassVar[float] = 0.25
    THRASH_RATIO: ClassVar[float] = 1.05
    THRASH_GATE: ClassVar[float] = 64.0

    def __init__(self, rate: float = 1.0) -> None:
        """`rate`: as AdaptivePolicy's (a miniature simulation's policy)."""
        # Its horizon stays one-use victims' age. Measured in admitted victims' lifetimes
        # instead, the frequency bonus won on zipf at 2% (0.79 -> 0.86 of the optimum) but
        # cost the agent trace at 25% 3.5% of lru's hits (bench.eviction_quality).
        self.inner = AdaptivePolicy(rate)
        self.decay = self.DECAY if rate <= 1 else 1 - min(0.5, (1 - self.DECAY) * rate)
        self.min_evidence = max(1, round(self.MIN_EVIDENCE / max(1.0, rate)))
        self._gate = self.INITIAL_GATE  # horizons
        # whose gate and horizon set the penalty (`follow`); None: its own. Never `self`: a
        # reference cycle would outlive blockd's young collections (blockd.server._tune_gc)
        self._leader: GatedPolicy | None = None
        # decayed victims and returns per side (on probation, admitted), in inflated units as
        # the inner policy's counters: an event adds `_scale`, nothing is multiplied per eviction
        self._victims = [0.0, 0.0]
        self._returns = [0.0, 0.0]
        self._scale = 1.0
        self._grow = 1 / self.decay
        self._num_evictions = 0
        self._since = 0  # evictions since the gate was computed
        self._stale = False

    @property
    def victims(self) -> list[float]:
        """Decayed evictions: on probation, admitted."""
        return [v / self._scale for v in self._victims]

    @property
    def gate(self) -> float:
        """Horizons a block on probation is aged by (0: open), as of the latest return or
        REFRESH evictions."""
        if self._stale:
            self._regate()
        return self._gate

    @gate.setter
    def gate(self, horizons: float) -> None:
        """Set until the next return or REFRESH evictions recompute it (tests, operators)."""
        self._gate = horizons

    @property
    def penalty(self) -> float:
        """Release ticks a block on probation is aged by."""
        leader = self._leader or self
        return leader.gate * max(leader.gate_horizon, self.inner.MIN_HORIZON)

    @property
    def gate_horizon(self) -> float:
        return self.inner.horizon

    def follow(self, leader: GatedPolicy) -> None:
        """Take the gate's strictness from `leader` (the device pool's policy, which the
        ghost table teaches) instead of learning it: a host tier decides with the same
        gate. Its own victims still teach its inner policy."""
        self._leader = leader

    def admits(self, block: Block) -> bool:
        """Whether the gate would keep `block` now: seen before, or the gate is open. For
        write rules outside the pool's eviction (a shared-tier write through)."""
        return block.num_seen + block.num_hits >= 2 or (self._leader or self).gate == 0.0

    def priority(self, block: Ranked) -> Priority:
        value, tick, uses, run = self.inner.priority(block)
        if uses < 2:
            leader = self._leader or self
            if leader._stale:
                leader._regate()
            if leader._gate:
                value -= leader._gate * max(leader.inner.horizon, AdaptivePolicy.MIN_HORIZON)
        return (value, tick, uses, run)

    def evicted(self, priority: Priority) -> None:
        self.inner.evicted(priority)
        scale = self._scale = self._scale * self._grow
        self._victims[0 if priority[2] < 2 else 1] += scale
        if scale > AdaptivePolicy.RENORMALISE:
            self._victims = [v / scale for v in self._victims]
            self._returns = [r / scale for r in self._returns]
            self._scale = 1.0
        self._num_evictions += 1
        self._since += 1
        if self._since >= AdaptivePolicy.REFRESH:
            self._stale = True

    def evicted_many(self, priority: Priority, num: int) -> None:
        # As `AdaptivePolicy.evicted_many`: the counters' float operations as `evicted`'s, in
        # one loop over locals; the counts advanced at once (the gate is recomputed when read).
        assert num >= 0, f"a negative number of victims: {num}"
        if not num:
            return
        scale, grow = self._scale, self._grow
        if _may_pass(scale, grow, num, AdaptivePolicy.RENORMALISE):
            for _ in range(num):
                self.evicted(priority)
            return
        self.inner.evicted_many(priority, num)
        side = 0 if priority[2] < 2 else 1
        victims = self._victims
        scale, victims[side] = _decayed_sum(scale, grow, victims[side], num)
        self._scale = scale
        self._num_evictions += num
        self._since += num
        if self._since >= AdaptivePolicy.REFRESH:
            self._stale = True

    def returned(self, num_uses: int, run_length: int = 0) -> None:
        self.inner.returned(num_uses, run_length)
        self._returns[0 if num_uses < 2 else 1] += self._scale
        self._stale = True

    def _regate(self) -> None:
        self._since = 0
        self._stale = False
        if self._num_evictions < self.min_evidence:
            return
        scale = self._scale
        (on_probation, admitted), (probation_returns, admitted_returns) = self._victims, self._returns
        base = (probation_returns + admitted_returns + scale) / (on_probation + admitted + 2 * scale)
        prior = self.inner.prior * scale
        probation_rate = (probation_returns + prior * base) / (on_probation + prior)
        admitted_rate = (admitted_returns + prior * base) / (admitted + prior)
        gate = admitted_rate / probation_rate / 2**self.MARGIN - 1
        if base > self.THRASH and admitted_rate > probation_rate * self.THRASH_RATIO:
            gate = max(gate, self.THRASH_GATE)
        self._gate = min(self.MAX_PENALTY, max(0.0, gate))


@mypyc_attr(allow_interpreted_subclasses=True)  # a user's policy may extend one (blockd.native)
class SimulatedPolicy(GatedPolicy):
    """`adaptive` that follows whichever of its candidates (`CANDIDATES`: its own order,
    lfu's, lru+seen2's, lfuda's) miniature simulations say hits most on this pool's traffic
    (blockd.minisim: each candidate on a sample of the block hashes with a pool scaled by
    the same factor, Waldspurger et al., USENIX ATC'17). Opt-in (`adaptive-sim`), not the
    default: it costs blockd CPU per admission (`PolicyChooser`'s docstring).

    The pool calls `observe` at each release once it has evicted; when the choice
    changes, the pool re-keys its heap (`EvictableLeaves.rekey`). Every order is one
    tuple shape (value, tick, uses, run), so the gate and the inner policy keep learning
    from the victims whichever order chose them, and the order the pool follows starts
    as `adaptive`'s. Host tiers follow the device's gate, in the adaptive order."""

    name: ClassVar[str] = "adaptive-sim"
    # The orders `priority` can give, by `_mode`: its own (adaptive's), lfu's, lru+seen2's, lfuda's.
    CANDIDATES: ClassVar[tuple[str, ...]] = ("adaptive", "lfu", "lru+seen2", "lfuda")

    def __init__(self) -> None:
        super().__init__()
        self._mode = 0  # index into CANDIDATES: whose order `priority` gives
        self._age = 0.0  # lfuda's: its victims' highest value while it is followed
        self._chooser: PolicyChooser | None = None

    def priority(self, block: Ranked) -> Priority:
        """The followed candidate's order, in adaptive's tuple shape (value, tick, uses, run)."""
        mode = self._mode
        if not mode:
            return super().priority(block)
        _, tick, uses, run = self.inner.priority(block)
        if mode == _LFU:  # verified hits (scaled by retention), then recency
            value = LfuPolicy.priority(_LFU_ORDER, block)[0]
        elif mode == _SEEN2:  # one-use blocks first, then retention, then recency
            value = (
                min(uses, 2) * (MAX_RETENTION + 1) + (block.retention or DEFAULT_RETENTION)
            ) * _TICKS + tick
        else:  # lfuda's: the age (its victims' highest value) plus uses, scaled by retention
            value = self._age + (uses * retention_weight(block) if block.retention else uses)
        return (value, tick, uses, run)

    @property
    def mode(self) -> str:
        """The candidate whose order the pool follows now (`CANDIDATES`)."""
        return self.CANDIDATES[self._mode]

    def observe(self, blocks: list[Block], tick: int, num_blocks: int) -> bool:
        """A sequence was released at `tick` with `blocks` (root first) from a pool of
        `num_blocks`: feed the miniature simulations (created on the first call, so a
        host tier's or a simulated policy never has them); answers whether the order
        changed (the caller re-keys its heap: priorities of two modes do not compare)."""
        chooser = self._chooser
        if chooser is None:
            chooser = self._chooser = PolicyChooser(num_blocks, self.CANDIDATES, _make_candidate)
        if not chooser.observe(blocks, tick):
            return False
        self._mode = chooser.best
        return True

    def evicted(self, priority: Priority) -> None:
        if self._mode == _LFUDA:
            self._age = max(self._age, priority[0])
        super().evicted(priority)

    def evicted_many(self, priority: Priority, num: int) -> None:
        if self._mode == _LFUDA and num > 0:
            self._age = max(self._age, priority[0])
        super().evicted_many(priority, num)


_LFU, _SEEN2, _LFUDA = 1, 2, 3  # SimulatedPolicy.CANDIDATES' indices
_LFU_ORDER = LfuPolicy()  # stateless: its order, for SimulatedPolicy
_TICKS = 2.0**40  # release ticks below this keep lru+seen2's order exact in one float


def _make_candidate(name: str, rate: float) -> EvictionPolicy:
    """A candidate policy for a miniature simulation on 1/`rate` of the keys (the adaptive
    one without simulations of its own). The adaptive policies count evictions: a
    simulation has 1/rate as many, so their windows and priors are scaled by it to span
    the same traffic. Unscaled, at rate ~10 the simulated adaptive policy learned 10x
    slower and ranked below lru+seen2 on long-conversation and one-off at 2%, where the
    pool ranks it above (rate 1 ranked them as the pool does; bench.eviction_quality)."""
    if name == GatedPolicy.name:
        return GatedPolicy(rate)
    return make_policy(name)


def _decayed_sum(scale: float, grow: float, total: float, num: int) -> tuple[float, float]:
    """(scale, total) after `num` evictions of one decayed counter, each as `evicted` does
    it (`scale *= grow`, then `total += scale`): the same products in the same order, so
    the same bits (a closed form rounds otherwise)."""
    for _ in range(num):
        scale *= grow
        total += scale
    return scale, total


def _may_pass(scale: float, grow: float, num: int, limit: float) -> bool:
    """Whether `num` evictions could take a decayed counter's `scale` past `limit` (where
    `evicted` renormalises). Each product by `grow` rounds by at most 2^-53 relative, so
    `num` of them stay within num x 1.2e-16 of `scale * grow ** num`: with a margin of
    1e-6 a no is exact for any batch under ~8e9 (a yes may be wrong: the caller then
    takes the per-eviction path, which is exact anyway)."""
    return scale * grow**num * (1 + 1e-6) > limit


POLICIES: dict[str, type[EvictionPolicy]] = {
    "adaptive": GatedPolicy,
    "adaptive-sim": SimulatedPolicy,
    "adaptive-ungated": AdaptivePolicy,
    "lru": LruPolicy,
    "lfu": LfuPolicy,
    "lfuda": LfuDaPolicy,
}
DEFAULT_POLICY = GatedPolicy.name  # measured: bench.eviction_quality (BENCHMARKS.md, section 6)
SEEN_TWICE = "+seen2"  # suffix: the policy under the seen-twice admission rule (SeenTwice)


@mypyc_attr(allow_interpreted_subclasses=True)  # a user's policy may extend one (blockd.native)
class SeenTwice:
    """The seen-twice admission rule over a policy, for one tier: a block used once
    (its commit, no hit, no remembered use) is on probation and evicted before any
    block used twice, in the inner policy's order within each group (2Q's and
    S3-FIFO's probation queue, unbounded). A benchmark variant (`lru+seen2`, ...):
    with tiers, the rule decides what is demoted instead."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.name = inner.name + SEEN_TWICE

    def priority(self, block: Ranked) -> Priority:
        return (min(block.num_seen + block.num_hits, 2), *self.inner.priority(block))

    def evicted(self, priority: Priority) -> None:
        self.inner.evicted(priority[1:])

    def evicted_many(self, priority: Priority, num: int) -> None:
        self.inner.evicted_many(priority[1:], num)

    def returned(self, num_uses: int, run_length: int = 0) -> None:
        self.inner.returned(num_uses, run_length)


POLICY_NAMES = sorted(POLICIES) + sorted(name + SEEN_TWICE for name in POLICIES)


def make_host_policy(device: EvictionPolicy) -> EvictionPolicy:
    """The policy of a pool's host tier: its own instance of the device pool's policy (a
    stateful policy learns from its own tier's evictions), whose admission gate, if it
    has one, follows the device's (the device's ghost table teaches the gate)."""
    host = make_policy(device.name)
    if isinstance(host, GatedPolicy) and isinstance(device, GatedPolicy):
        host.follow(device)
    return host


def admits(policy: EvictionPolicy, block: Block) -> bool:
    """Whether `policy` would keep `block` (True for every policy without a gate)."""
    return policy.admits(block) if isinstance(policy, GatedPolicy) else True


def make_policy(name: str) -> EvictionPolicy:
    base = name.removesuffix(SEEN_TWICE)
    if base not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {POLICY_NAMES}")
    policy = POLICIES[base]()
    return SeenTwice(policy) if name != base else policy


class EvictableLeaves:
    """Min-heap of evictable leaves by policy priority, with lazy invalidation.

    `push` stamps the block with a fresh key; an entry is valid only while the
    block still carries that key and is still an evictable leaf. A block that is hit
    again (or gains a cached child) simply leaves a stale entry behind, skipped by
    `pop`; so is one pushed again with a newer priority. Costs: push O(log n), pop
    O(log n) amortised; the heap is rebuilt from its valid entries when stale ones
    outnumber them, which keeps its size O(evictable blocks).
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._heap: list[tuple[Priority, int, Block]] = []
        self._keys = count()

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    def push(self, block: Block, priority: Priority | None = None) -> None:
        """Enter `block` with `priority`, or the policy's priority for it now."""
        assert block.is_evictable_leaf, f"only evictable leaves enter the heap: {block}"
        key = next(self._keys)
        block.heap_key = key
        if priority is None:
            priority = self._policy.priority(block)
        heapq.heappush(self._heap, (priority, key, block))

    @property
    def priority(self) -> Callable[[Block], Priority]:
        """The policy's priority function (smallest evicted first)."""
        return self._policy.priority

    def first_priority(self) -> Priority | None:
        """The smallest priority in the heap (None when empty). A stale entry may hold
        it, so a block whose priority is below it would be popped first if pushed (a
        pushed block loses ties: its key is the newest), and the heap can skip it."""
        heap = self._heap
        return heap[0][0] if heap else None

    def takes_next(self, priority: Priority, bar: Priority | None) -> bool:
        """Whether an evictable leaf not in the heap, pushed now with `priority`, would
        be popped next (its priority is below `bar`, the heap's first; None: an empty
        heap); if so it counts as evicted for the policy, exactly as a pop would."""
        if bar is not None and not priority < bar:
            return False
        self._policy.evicted(priority)
        return True

    def pop(self) -> Block | None:
        """The evictable leaf of smallest priority, or None when there is none."""
        entry = self.pop_entry()
        return entry[1] if entry is not None else None

    def pop_entry(self) -> tuple[Priority, Block] | None:
        """`pop`, with the priority its entry was pushed with."""
        heap = self._heap
        while heap:
            priority, key, block = heapq.heappop(heap)
            if block.heap_key == key and block.is_evictable_leaf:
                block.heap_key = None
                self._policy.evicted(priority)
                return priority, block
        return None

    def rekey(self) -> None:
        """Recompute every valid entry's priority (the policy's order changed: entries
        pushed under the old one do not compare with new ones). O(n); rare (a change of
        `GatedPolicy.mode`)."""
        priority = self._policy.priority
        self._heap = [
            (priority(block), key, block)
            for _, key, block in self._heap
            if block.heap_key == key and block.is_evictable_leaf
        ]
        heapq.heapify(self._heap)

    def compact(self, num_evictable: int) -> None:
        """Drop stale entries once they dominate (call after operations that hit)."""
        if len(self._heap) > 2 * num_evictable + 1024:
            self._heap = [
                entry for entry in self._heap if entry[2].heap_key == entry[1] and entry[2].is_evictable_leaf
            ]
            heapq.heapify(self._heap)

    def valid_blocks(self) -> list[Block]:
        """Blocks with a valid entry, for invariant checks (O(n))."""
        return [block for _, key, block in self._heap if block.heap_key == key and block.is_evictable_leaf]
