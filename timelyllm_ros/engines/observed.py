"""Latency a real engine observes of itself: the estimates admission reads between iterations.

A real engine has no calibration to consult; it learns its prefill throughput and its
decode-step time per batch size from the iterations it runs (exponential moving averages),
and answers :meth:`Engine.run_cost_s` / :meth:`Engine.decode_step_s` from them. The simulated
engine's counterpart is :class:`~timelyllm_ros.engines.calibration.Calibration`; where a
calibration declares ``estimates='observed'`` the simulated engine answers as the vLLM engines
do, with :func:`new_request_join_tokens` and :class:`ObservedLatency` over its own iterations,
so that a replay takes the decisions the real engine took.
"""

from __future__ import annotations

NEW_REQUEST_DEFAULT_TPS = 2000.0
"""Prefill throughput the vLLM engines assume before they have observed a prefill."""

NEW_REQUEST_DEFAULT_DECODE_S = 0.02
"""Decode-step time the vLLM engines assume before they have observed a decode."""


def new_request_join_tokens(tokens: int, resumed: bool, block_size: int) -> int:
    """Tokens a join into an engine that resumes by new request (vLLM) is priced at: a
    resumed generation's last, partial block (its full blocks are in the prefix cache), a new
    one's whole context."""
    return (tokens % block_size or block_size) if resumed else tokens


class ObservedLatency:
    """Moving averages of prefill throughput and of decode-step time per batch size."""

    PREFILL_WEIGHT = 0.5      # of the newest prefill rate
    DECODE_WEIGHT = 0.3       # of the newest decode step at a batch size

    def __init__(self, min_prefill_tokens: int = 1) -> None:
        """Args:
            min_prefill_tokens: prefill iterations over fewer tokens are not rated (their time
                is mostly fixed cost, so they would understate the throughput).
        """
        self.min_prefill_tokens = min_prefill_tokens
        self.decode_s: dict[int, float] = {}          # batch size -> step time (s)
        self.prefill_tps: float | None = None        # prefill tokens per second

    def record_prefill(self, tokens: int, duration_s: float) -> None:
        if duration_s > 0 and tokens >= self.min_prefill_tokens:
            rate = tokens / duration_s
            w = self.PREFILL_WEIGHT
            self.prefill_tps = rate if self.prefill_tps is None else (
                w * rate + (1 - w) * self.prefill_tps)

    def record_decode(self, batch_size: int, duration_s: float) -> None:
        old = self.decode_s.get(batch_size)
        w = self.DECODE_WEIGHT
        self.decode_s[batch_size] = duration_s if old is None else (
            (1 - w) * old + w * duration_s)

    def prefill_s(self, tokens: int, default_tps: float) -> float:
        """Time to prefill ``tokens`` at the observed rate (``default_tps`` before any)."""
        return tokens / (self.prefill_tps or default_tps)

    def interpolated_decode_s(self, batch_size: int, default_s: float,
                              extrapolate: bool = False) -> float:
        """Decode-step time at ``batch_size``: observed, else linear between the observed batch
        sizes around it; outside them the nearest observed one, or, with ``extrapolate``, the
        line through the last two below it. ``default_s`` before any observation."""
        known = self.decode_s
        if batch_size in known:
            return known[batch_size]
        sizes = sorted(known)
        if not sizes:
            return default_s
        lower = [b for b in sizes if b < batch_size]
        upper = [b for b in sizes if b > batch_size]
        if lower and upper:
            b0, b1 = lower[-1], upper[0]
        elif extrapolate and len(lower) >= 2:
            b0, b1 = lower[-2], lower[-1]
        else:
            return known[lower[-1] if lower else upper[0]]
        t0, t1 = known[b0], known[b1]
        return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)

    def nearest_decode_s(self, batch_size: int, default_s: float) -> float:
        """Decode-step time at ``batch_size`` as the vLLM engines estimate it: observed, else
        the nearest observed batch size's, grown by (batch ratio)^0.1 above it; ``default_s``
        before any observation."""
        known = self.decode_s
        if batch_size in known:
            return known[batch_size]
        if not known:
            return default_s
        nearest = min(known, key=lambda b: abs(b - batch_size))
        return float(known[nearest] * max(1.0, batch_size / nearest) ** 0.1)
