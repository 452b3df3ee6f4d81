"""Server counters and their Prometheus text exposition (GET /metrics).

The worker thread and the request handlers write; a scrape reads. Each update is a
few integer operations under one lock, so a scrape sees a consistent snapshot.

Names follow the Prometheus conventions (`_total` counters, `_seconds` units) under
the `fucina_` prefix: requests by outcome, queue depth, active and prefilling
streams, prompt / generated tokens (rate() gives tokens per second; a gauge also
carries the last 10 s), the time-to-first-token histogram, and the prefix cache: prompt
tokens served from a slot's own rows, copied from another slot's, or computed.
"""
from __future__ import annotations

import bisect
import collections
import threading
import time

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
RATE_WINDOW = 10.0    # seconds the tokens-per-second gauge looks back


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = collections.Counter()      # outcome -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.reused_tokens = 0        # the slot already held them
        self.copied_tokens = 0        # copied from another slot's rows
        self.prefix_hits = 0          # requests that computed less than their whole prompt
        self.passes = 0               # model passes
        self.pass_rows = 0            # rows over all passes
        self.active = 0
        self.prefilling = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    # -- updates (any thread) ---------------------------------------------------------
    def prompt(self, tokens: int, reused: int, copied: int) -> None:
        with self._lock:
            self.prompt_tokens += tokens
            self.reused_tokens += reused
            self.copied_tokens += copied
            self.prefix_hits += reused + copied > 0

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_counts[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
            self.ttft_sum += seconds

    def generated(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.generated_tokens += n
            self._recent.append((now, n))
            self._trim(now)

    def finished(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def step(self, rows: int, active: int, prefilling: int) -> None:
        with self._lock:
            self.passes += 1
            self.pass_rows += rows
            self.active, self.prefilling = active, prefilling

    def idle(self) -> None:
        with self._lock:
            self.active = self.prefilling = 0

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent.popleft()

    # -- reads -------------------------------------------------------------------------
    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW

    def cache_hit_ratio(self) -> float:
        with self._lock:
            return (self.reused_tokens + self.copied_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    def render(self, queue_depth: int, streams: int) -> str:
        """The Prometheus text format (version 0.0.4)."""
        tps = self.tokens_per_second()
        hit = self.cache_hit_ratio()
        with self._lock:
            out: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
                out.append(f"# HELP fucina_{name} {help_}")
                out.append(f"# TYPE fucina_{name} {kind}")
                out.extend(f"fucina_{name}{labels} {_num(v)}" for labels, v in samples)

            outcomes = ("completed", "cancelled", "failed") + tuple(sorted(set(self.requests) - {
                "completed", "cancelled", "failed"}))
            metric("requests_total", "counter", "Requests the engine finished, by outcome.",
                   [(f'{{outcome="{o}"}}', self.requests[o]) for o in outcomes])
            metric("queue_depth", "gauge", "Requests waiting for a stream.", [("", queue_depth)])
            metric("streams_active", "gauge", "Streams in the running batch (prefilling or decoding).",
                   [("", self.active)])
            metric("streams_prefilling", "gauge", "Streams whose prompt is still being computed.",
                   [("", self.prefilling)])
            metric("streams_max", "gauge", "Streams the engine runs at once.", [("", streams)])
            metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                   [("", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
            metric("generation_tokens_per_second", "gauge", f"Tokens generated per second over the last "
                   f"{RATE_WINDOW:g} s.", [("", round(tps, 3))])
            metric("prompt_tokens_cached_total", "counter", "Prompt tokens not computed, by source "
                   "(own: the slot held them; copied: another slot's rows).",
                   [('{source="own"}', self.reused_tokens), ('{source="copied"}', self.copied_tokens)])
            metric("prefix_cache_hits_total", "counter", "Requests that reused part of their prompt.",
                   [("", self.prefix_hits)])
            metric("prefix_cache_hit_ratio", "gauge", "Share of prompt tokens served from cached rows.",
                   [("", round(hit, 4))])
            metric("model_passes_total", "counter", "Batched model passes.", [("", self.passes)])
            metric("model_pass_rows_total", "counter", "Token rows over all model passes.",
                   [("", self.pass_rows)])
            out.append("# HELP fucina_time_to_first_token_seconds Time from arrival to the first token.")
            out.append("# TYPE fucina_time_to_first_token_seconds histogram")
            acc = 0
            for le, c in zip(TTFT_BUCKETS + (float("inf"),), self.ttft_counts):
                acc += c
                out.append(f'fucina_time_to_first_token_seconds_bucket{{le="{_num(le)}"}} {acc}')
            out.append(f"fucina_time_to_first_token_seconds_sum {_num(round(self.ttft_sum, 6))}")
            out.append(f"fucina_time_to_first_token_seconds_count {acc}")
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return str(int(v)) if float(v).is_integer() else repr(float(v))
