"""Histograms of the requests an engine serves: how long each waited for a slot and for its first
token, the time between its tokens, its whole time, its prompt's and its output's lengths.

Each is a Prometheus histogram: fixed upper bounds, for each bound the number of observations at
or below it, their sum and their count. An engine keeps them from its start and reports them with
its counters (`as_dict`); the same bucket of two replicas adds up, so serve_app/metrics.py sums
them for the cluster as it sums counters.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

# 1 ms to 1,000 s: a cached prompt's first token on a GPU to a long generation on a CPU
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0,
           250.0, 1000.0)
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)  # the prompt limit's default


class Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is past every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def as_dict(self) -> dict:
        """{"buckets": {"0.001": n, ..., "+Inf": count} (cumulative, as Prometheus' `le`), "sum", "count"}."""
        buckets, seen = {}, 0
        for bound, n in zip([*map(_label, self.bounds), "+Inf"], self.counts, strict=True):
            seen += n
            buckets[bound] = seen
        return {"buckets": buckets, "sum": self.total, "count": seen}


def _label(bound: float) -> str:
    return repr(float(bound))


class RequestHistograms:
    """The engine's histograms, by their metric names (seconds measured on the engine's clock: from
    the request's arrival at the engine, which excludes the HTTP and routing before it)."""

    def __init__(self) -> None:
        self.queue = Histogram(SECONDS)  # arrival to a slot
        self.first_token = Histogram(SECONDS)  # arrival to the first token on the host
        self.between_tokens = Histogram(SECONDS)  # a token to the request's next one
        self.whole = Histogram(SECONDS)  # arrival to the end, whatever the reason
        self.prompt = Histogram(TOKENS)
        self.generated = Histogram(TOKENS)

    def as_dict(self) -> dict[str, dict]:
        return {
            "request_queue_seconds": self.queue.as_dict(),
            "time_to_first_token_seconds": self.first_token.as_dict(),
            "inter_token_seconds": self.between_tokens.as_dict(),
            "request_seconds": self.whole.as_dict(),
            "request_prompt_tokens": self.prompt.as_dict(),
            "request_generated_tokens": self.generated.as_dict(),
        }
