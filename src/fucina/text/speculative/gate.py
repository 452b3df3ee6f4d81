"""CostGate: speculation runs only while it pays.

The estimate is committed tokens per plain-step-equivalent of verify cost over the last
`rate_window` verify passes, where cost(k) is what a verify of 1 + k rows costs against
one plain step: a table measured on this project's CPU kernels, rescaled online by the
decoder's own timings (an EWMA per draft length over an EWMA of plain steps, clamped so
one noisy measurement cannot swing it). The timings live in a `CostModel` that every
stream decoding on the same model, thread count and ISA shares (`shared_costs`), so a
new conversation or server request starts from the costs the earlier ones measured,
and a draft length not timed yet follows the measured ones' scale. Below `min_speedup` the gate switches
speculation off; it re-probes after `reprobe_after` plain steps (doubling up to
`reprobe_max` each time a probe fails) and switches back on only with a
`probe_margin` of headroom. The draft budget follows the rolling acceptance rate.
The gate decides WHEN speculation runs, never WHAT is committed.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import deque

from fucina.errors import FucinaError

# (draft tokens k, cost of a verify of 1 + k rows in plain steps): measured on the
# batch-invariant native kernels with SmolLM2-135M Q4_1 and Gemma-3-270M Q4_K_M on this
# project's Zen 5 box (median of 9 paired, process CPU time, 1 thread, two runs per model
# on a shared box: benchmarks/speculative.py --costs), the mean of the two models, per
# ISA level. Up to 8 rows share one pass over the weights (the m <= 8 decode GEMV); from
# 9 rows the panel (GEMM) route costs a step more, then grows slowly. AVX2's rows cost
# more (its integer dots bound every layout: ~0.3-0.45 of a step an extra row, and the
# K-quants take the panel route from 3 rows without VNNI). Interpolated between points,
# extrapolated past the last.
DEFAULT_COST_TABLE: tuple[tuple[int, float], ...] = (
    (0, 1.0), (1, 1.05), (2, 1.2), (3, 1.4), (4, 1.5), (5, 1.65), (6, 1.85), (7, 1.95), (8, 3.15), (12, 3.85),
    (16, 4.5))
COST_TABLES: dict[str, tuple[tuple[int, float], ...]] = {
    "avx512": DEFAULT_COST_TABLE,
    "avx2vnni": ((0, 1.0), (1, 1.12), (2, 1.3), (3, 1.53), (4, 1.77), (5, 2.0), (6, 2.29), (7, 2.44), (8, 3.52),
                 (12, 4.37), (16, 5.17)),
    "avx2": ((0, 1.0), (1, 1.17), (2, 1.47), (3, 1.75), (4, 2.02), (5, 2.26), (6, 2.48), (7, 2.74), (8, 4.05),
             (12, 5.03), (16, 6.12)),
}


def default_cost_table() -> tuple[tuple[int, float], ...]:
    """The cost table of the ISA level the kernels run with now (AVX-512's elsewhere:
    the timings rescale it)."""
    from fucina import kernels
    return COST_TABLES.get(kernels.isa(), DEFAULT_COST_TABLE)


# a draft's acceptance depends on the evidence behind it: the exact match it follows.
# Match lengths below 2 (the recycling chain), 2-3, 4-7, 8-15 and 16+ keep their own
# rolling acceptance, so short matches stop costing verify rows while long ones draft long.
MATCH_BUCKETS = (2, 4, 8, 16)
MTP_BUCKET = len(MATCH_BUCKETS) + 1   # drafts of a multi-token-prediction head: a bucket of their own
BUCKET_DECAY = 0.85   # per verify pass of the bucket: the last ~7 passes weigh most
BUCKET_PRIOR = 2.0    # draft tokens' worth of the bucket's prior acceptance mixed into its rate
BUCKET_PRIORS = (0.3, 0.5, 0.65, 0.8, 0.9, 0.5)   # until measured: a longer match continues more often
BUCKET_PROBE = 16     # a bucket the budget skips drafts again after this many skipped steps,
BUCKET_PROBE_MAX = 256   # doubling after each probe that accepts nothing, up to this


def match_bucket(match: int) -> int:
    return bisect_right(MATCH_BUCKETS, match)     # how many thresholds the match reaches


# in a shared pass (the server's batch): drafts must beat the draft-free pass by this
# margin. Priced by ragged passes measured per rows per cache (benchmarks/speculative.py
# --ragged-costs: a pass of n single rows over n caches costs the one-cache pass of n rows
# plus ~0.03-0.12 steps a cache, so the table prices the draft rows' extra right) and
# replayed on the 4-request server runs (every pass's shape priced by the measured
# tables): margin 0.3 left speculation nearly off (est. 1.00-1.16x), 0.1 gave 1.02-1.19x
# (SmolLM2 default mix, a copy-heavy one, Gemma-3) and 1.00 where every stream but one
# is free-form; 0.0 lost there (0.99). A pass is kept within the rows the cost table
# measured (1 + 16).
SHARED_MARGIN = 0.10
SHARED_MAX_ROWS = 17
# a bucket's re-probe in a shared pass may add at most this much to the pass (in steps):
# with the 4-row GEMV a 1-token probe beside 3 other streams made the pass a 5-row one
# (+0.85 steps), and SmolLM2's 4-stream server paid ~8 of those a run for ~1 token each
# (3-5% of the run); with the 8-row GEMV the step is at the ninth row
SHARED_PROBE_EXTRA = 0.5

MIN_ROW_COST = 0.02   # the least a verify row can add to a step (its head row, its attention)
# timings refresh the memoized budgets every this many samples of a shape (and when a shape
# starts counting): an EWMA moves slowly, and re-solving the budget at every plain step
# cost ~20 us a token, the gated-off decoder's largest overhead
BUDGET_REFRESH = 16
TIMED_AFTER = 3       # samples of a shape (the first is warm-up) before its timing rescales the table


def table_cost(table, k: int) -> float:
    pts = sorted(table)
    if k <= pts[0][0]:
        return pts[0][1]
    for (k0, c0), (k1, c1) in zip(pts, pts[1:]):
        if k <= k1:
            return c0 + (c1 - c0) * (k - k0) / (k1 - k0)
    (k0, c0), (k1, c1) = pts[-2], pts[-1]
    return c1 + (c1 - c0) * (k - k1) / (k1 - k0)


class CostModel:
    """Measured forward times by draft length k (k = 0: a plain step; k > 0: a verify of
    1 + k rows on one cache), as EWMAs; `version` moves whenever a ratio a gate reads may
    have changed (the gates memoize their budgets by it)."""

    def __init__(self):
        self.plain_time: float | None = None
        self.verify_time: dict[int, float] = {}
        self.samples: dict[int, int] = {}     # timings seen per draft length (the first is warm-up)
        self.version = 0

    def record(self, k: int, seconds: float) -> None:
        self.samples[k] = self.samples.get(k, 0) + 1
        n = self.samples[k]
        if n == 1:
            return
        if n == TIMED_AFTER or n % BUDGET_REFRESH == 0:
            self.version += 1
        if k == 0:
            self.plain_time = seconds if self.plain_time is None else 0.8 * self.plain_time + 0.2 * seconds
        else:
            old = self.verify_time.get(k)
            self.verify_time[k] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def ratio(self, k: int) -> float | None:
        """t(1 + k rows) / t(1 row), once both shapes have TIMED_AFTER samples."""
        t = self.verify_time.get(k)
        if t is None or not self.plain_time or min(self.samples.get(k, 0), self.samples.get(0, 0)) < TIMED_AFTER:
            return None
        return t / self.plain_time

    def timed(self) -> list[int]:
        return [k for k in self.verify_time if self.ratio(k) is not None]


def shared_costs(model) -> CostModel:
    """The CostModel of every stream speculating on `model` at the current thread count
    and ISA (kept on the model object: its lifetime is the model's)."""
    from fucina import kernels
    attrs = getattr(model, "__dict__", None)
    if attrs is None:
        return CostModel()
    table = attrs.setdefault("_spec_costs", {})
    key = (kernels.get_threads(), kernels.isa())
    cm = table.get(key)
    if cm is None:
        cm = table[key] = CostModel()
    return cm


class CostGate:
    def __init__(self, *, max_draft: int = 16, min_draft: int = 2, rate_window: int = 16,
                 min_window_drafted: int = 4, min_speedup: float = 1.0, probe_margin: float = 0.10,
                 reprobe_after: int = 128, reprobe_max: int = 1024, probe_steps: int = 4,
                 cost_table=None, adapt_budget: bool = True, timed: bool = True):
        if cost_table is None:
            cost_table = default_cost_table()
        if rate_window < 2 or probe_steps < 1 or reprobe_after < 1 or not cost_table:
            raise FucinaError("cost gate: rate_window >= 2, probe_steps >= 1, reprobe_after >= 1 "
                              "and a non-empty cost table are required")
        self.max_draft, self.min_draft = max_draft, min_draft
        self.rate_window, self.min_window_drafted = rate_window, min_window_drafted
        self.min_speedup, self.probe_margin = min_speedup, probe_margin
        self.reprobe_after, self.reprobe_max, self.probe_steps = reprobe_after, reprobe_max, probe_steps
        self.table = tuple(cost_table)
        self._prior = [table_cost(self.table, k) for k in range(max_draft + 1)]
        self._pass_costs: dict[int, float] = {}
        self.adapt_budget, self.timed = adapt_budget, timed
        self.window: deque[tuple[int, int, int, float]] = deque()  # (drafted, accepted, committed, cost)
        self.costs = CostModel()      # this gate's own until bind() shares one
        self._costs_seen = 0          # the CostModel version the scale and memoized budgets were made with
        self._scale = 1.0
        self.on = True
        self.off_for = 0              # plain steps left before the next probe
        self.backoff = reprobe_after
        self.probing = 0              # probe verify passes left
        self.switches = 0
        self._budgets: dict[tuple, int] = {}  # by (shared rows, bucket), until the window or a timing changes
        n = len(MATCH_BUCKETS) + 2
        self.draft_cost = 0.0         # plain steps a drafted token costs its source (the MTP head's passes)
        self.bucket_drafted, self.bucket_accepted = [0.0] * n, [0.0] * n   # decayed counts
        self.bucket_skips = [0] * n
        self.bucket_wait = [BUCKET_PROBE] * n       # skipped steps before the next probe
        self.bucket_probed = [False] * n            # a probe's verdict is pending

    # -- costs --------------------------------------------------------------------------

    def bind(self, costs: CostModel) -> None:
        """Read (and record) timings in `costs`, shared with other streams on the model."""
        if costs is not self.costs:
            self.costs = costs
            self._costs_seen = -1      # refit at the next read

    def cost(self, k: int) -> float:
        """A verify of 1 + k rows in plain steps as measured: the table's extra-row cost
        times one factor fitted to every timed draft length (per-length EWMAs drifted
        apart in the real loop: SmolLM2 after five chats read k = 3 at 2.2 steps, k = 4 at
        1.8). The on/off decision and the speedup estimate use it."""
        return self._scaled(k, lambda s: s)

    def budget_cost(self, k: int) -> float:
        """The cost the draft budget is solved with: the table's, lowered where the
        timings say rows are cheaper (a bigger, memory-bound model drafts longer), never
        raised. The budget's acceptance model (each token survives with one rate) is
        pessimistic about long drafts, since a copy that has started tends to go on; the
        table's lower costs offset it: with the measured SmolLM2 costs (x1.3-1.5 the
        table's extra) the budgets ran shorter and the speedup fell (8 paired runs, one
        thread: summary 1.60 vs 1.72, edit 1.22 vs 1.28, copy 2.13 vs 2.29). The gate's
        on/off decision keeps the measured costs, so a machine where rows cost more
        than the table still turns speculation off when it stops paying."""
        return self._scaled(k, lambda s: min(s, 1.0))

    def _scaled(self, k: int, factor) -> float:
        prior = self._prior[k] if k < len(self._prior) else table_cost(self.table, k)
        if not self.timed or k == 0:
            return prior
        return max(1.0 + (prior - 1.0) * factor(self.scale()), 1.0 + MIN_ROW_COST * k)

    def scale(self) -> float:
        """Measured over tabled extra-row cost, summed over the timed draft lengths
        (samples capped at 16 a length, so one common shape does not decide alone; a
        ratio of sums, so k = 1's small and noisy extra weighs little), clamped to
        [0.5, 2]: one noisy timing cannot swing it. 1.0 until timed."""
        self._sync_costs()
        return self._scale

    def _sync_costs(self) -> None:
        """After the CostModel moved: the scale refitted, the memoized budgets dropped."""
        if self._costs_seen == self.costs.version:
            return
        self._costs_seen = self.costs.version
        self._budgets.clear()
        num = den = 0.0
        for k in self.costs.timed():
            p = table_cost(self.table, k) - 1.0
            if p > 0:
                w = min(self.costs.samples[k], BUDGET_REFRESH)
                num += w * (self.costs.ratio(k) - 1.0)
                den += w * p
        self._scale = min(max(num / den, 0.5), 2.0) if den else 1.0

    def record(self, k: int, seconds: float) -> None:
        """The forward time of a pass with k draft tokens (k = 0: a plain step). The
        first pass of each shape is not timed (one-off allocations, cold caches)."""
        self.costs.record(k, seconds)

    # -- the estimate -------------------------------------------------------------------

    def settle(self, drafted: int, accepted: int, committed: int, bucket: int | None = None) -> None:
        self._budgets.clear()
        if bucket is not None:
            self.bucket_drafted[bucket] = BUCKET_DECAY * self.bucket_drafted[bucket] + drafted
            self.bucket_accepted[bucket] = BUCKET_DECAY * self.bucket_accepted[bucket] + accepted
            if self.bucket_probed[bucket]:
                self.bucket_probed[bucket] = False
                self.bucket_wait[bucket] = BUCKET_PROBE if accepted else \
                    min(2 * self.bucket_wait[bucket], BUCKET_PROBE_MAX)
        if bucket == MTP_BUCKET:
            # the head has its own acceptance gate and bucket budget: its misses must not switch
            # the whole cascade off (SmolLM2 copy with a weak head: x1.31 against x1.84 without it)
            return
        self.window.append((drafted, accepted, committed, self.cost(drafted)))
        while len(self.window) > self.rate_window:
            self.window.popleft()
        if self.probing:
            self.probing -= 1
            if self.probing == 0:
                self._decide(self.min_speedup + self.probe_margin, probe=True)
        elif self.on and len(self.window) >= 4 and sum(w[0] for w in self.window) >= self.min_window_drafted:
            self._decide(self.min_speedup, probe=False)

    def est_speedup(self) -> float:
        cost = sum(w[3] for w in self.window)
        return sum(w[2] for w in self.window) / cost if cost else 1.0

    def acceptance(self) -> float:
        d = sum(w[0] for w in self.window)
        return sum(w[1] for w in self.window) / d if d else 1.0

    def _decide(self, threshold: float, probe: bool) -> None:
        if self.est_speedup() >= threshold:
            if probe:
                self.backoff = self.reprobe_after
            self.on = True
            return
        if self.on or probe:
            self.switches += 1
        self.on = False
        self.off_for = self.backoff
        if probe:
            self.backoff = min(2 * self.backoff, self.reprobe_max)
        self.window.clear()
        self._budgets.clear()

    # -- what the decoder asks ----------------------------------------------------------

    def active(self) -> bool:
        return self.on or self.probing > 0

    def tick(self, strong_match: bool = False) -> None:
        """One plain step taken while off; the probe starts when the wait is over, or at
        once when the source reports a long exact match (a copy is starting)."""
        if self.off_for > 0:
            self.off_for = 0 if strong_match else self.off_for - 1
        if self.off_for == 0 and not self.on and not self.probing:
            self.probing = self.probe_steps

    def set_draft_cost(self, steps: float) -> None:
        """What a drafted token costs its source, in plain steps (0 for index lookups);
        the memoized budgets are dropped when it moves by more than 10%."""
        if abs(steps - self.draft_cost) > 0.1 * max(self.draft_cost, 1e-3):
            self._budgets.clear()
        self.draft_cost = steps

    def budget(self, shared: int = 0, bucket: int | None = None) -> int:
        """Draft tokens worth verifying: the k maximising expected committed tokens per
        cost under the acceptance rate a (each draft token survives with a).
        `shared`: rows other streams put in the same pass (the server's batch); then the
        pass's cost is that of all its rows (past the decode GEMV's rows, 8 on AVX-512,
        a pass costs a step more).
        `bucket` (match_bucket of the draft's evidence): a is that bucket's acceptance,
        and k = 0 (no draft, a plain step) wins where drafting does not pay; such a
        bucket is re-probed after BUCKET_PROBE skipped steps (twice as long after each
        probe that accepted nothing, up to BUCKET_PROBE_MAX). Without a bucket nor a
        shared pass: the best k >= min_draft (the on/off decision is the gate's)."""
        if not self.adapt_budget and not shared and bucket is None:
            return self.max_draft
        self._sync_costs()
        key = (shared, bucket)
        k = self._budgets.get(key)
        if k is None:
            k = self._budgets[key] = self._best_k(shared, bucket)
        if k == 0 and bucket is not None:
            self.bucket_skips[bucket] += 1
            if self.bucket_skips[bucket] >= self.bucket_wait[bucket]:
                probe = self._best_k(shared, bucket, skip=False)
                while shared and probe >= self.min_draft and \
                        self.pass_cost(shared + 1 + probe) - self.pass_cost(shared + 1) > SHARED_PROBE_EXTRA:
                    probe -= 1
                if probe < self.min_draft:
                    return 0       # too dear beside the other rows: probe at a cheaper pass
                self.bucket_skips[bucket] = 0
                self.bucket_probed[bucket] = True
                return probe
        return k

    def bucket_acceptance(self, bucket: int | None) -> float:
        if bucket is None:
            return min(self.acceptance(), 0.999) if len(self.window) >= 2 else 0.6   # a prior until measured
        d, acc = self.bucket_drafted[bucket], self.bucket_accepted[bucket]
        return min((acc + BUCKET_PRIOR * BUCKET_PRIORS[bucket]) / (d + BUCKET_PRIOR), 0.999)

    def _best_k(self, shared: int, bucket: int | None = None, skip: bool = True) -> int:
        a = self.bucket_acceptance(bucket)
        if skip and (shared or bucket is not None):      # k = 0: this pass without a draft
            best_k, best = 0, (shared + 1) / self.pass_cost(shared + 1)
            if shared:            # a batch's economics are less certain than one stream's
                best *= 1.0 + SHARED_MARGIN
        else:
            best_k, best = self.max_draft, -1.0
        top = self.max_draft if not shared else min(self.max_draft, SHARED_MAX_ROWS - shared - 1)
        expect, p = 1.0, 1.0
        for k in range(1, top + 1):
            p *= a
            expect += p
            if k >= self.min_draft:
                extra = k * self.draft_cost
                value = (shared + expect) / (self.pass_cost(shared + 1 + k) + extra) if shared else \
                    expect / (self.budget_cost(k) + extra)
                if value > best + 1e-9:
                    best_k, best = k, value
        return best_k if self.adapt_budget or best_k == 0 else self.max_draft

    def pass_cost(self, rows: int) -> float:
        """A pass of `rows` rows (any streams) in plain steps: the table's 1 + k rows."""
        c = self._pass_costs.get(rows)
        if c is None:
            c = self._pass_costs[rows] = table_cost(self.table, rows - 1)
        return c
