"""Calibration data of a deployment: the latency model the simulated engine runs on.

A calibration describes the model on its hardware (prefill and decode latency, KV memory,
swap bandwidth) and, since schema 2, the serving engine too (:class:`EngineBehaviour`): the
fixed host cost of an iteration, prefill chunking, how many requests join per iteration, and
what resuming a suspended generation costs. Schema-1 files (no ``engine`` section) load with
the idealised engine they were written for: no fixed cost, whole prefills, free resumes.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from timelyllm_ros.engines.base import EngineBehaviour, ResumeModel
from timelyllm_ros.errors import EngineError
from timelyllm_ros.safe_files import YAML_FILE, EngineInputError, load_yaml

CALIBRATION_DIR = Path(__file__).resolve().parent.parent / 'data' / 'calibration'
DEFAULT_CALIBRATION = 'llama3-8b-fp16_rtx4090'


# Latencies are finite and not negative: a NaN or infinite one would stop the simulated clock.
_Ms = Annotated[float, Field(ge=0)]


class _Curve(BaseModel):
    model_config = ConfigDict(extra='forbid', frozen=True, allow_inf_nan=False)


class PrefillCurve(_Curve):
    tokens: list[int] = Field(min_length=2)
    ms: list[_Ms] = Field(min_length=2)

    @model_validator(mode='after')
    def _shape(self) -> PrefillCurve:
        if len(self.tokens) != len(self.ms) or sorted(self.tokens) != self.tokens:
            raise ValueError('tokens must be increasing and as long as ms')
        return self


class DecodeCurve(_Curve):
    reference_context_tokens: int = Field(ge=0)
    batch: list[int] = Field(min_length=1)
    ms: list[_Ms] = Field(min_length=1)

    @model_validator(mode='after')
    def _shape(self) -> DecodeCurve:
        if len(self.batch) != len(self.ms) or sorted(self.batch) != self.batch:
            raise ValueError('batch must be increasing and as long as ms')
        return self


SCHEMA_VERSION = 2
"""The calibration schema this package writes (1: no ``engine`` section)."""

__all__ = ['Calibration', 'EngineBehaviour', 'ResumeModel', 'load_calibration',
           'piecewise_linear']


class Calibration(BaseModel):
    """Prefill and decode latency, KV capacity, swap bandwidth and engine behaviour of one
    deployment (model, hardware, serving engine)."""

    model_config = ConfigDict(extra='forbid', frozen=True, allow_inf_nan=False)

    schema_version: Literal[1, 2] = 1
    model: str
    gpu: str
    source: str
    prefill_ms: PrefillCurve
    decode_ms: DecodeCurve
    decode_ms_per_context_token: float = Field(ge=0)
    prefill_ms_per_context_token: float = Field(default=0.0, ge=0)  # per new token and per
                        # token already in its context: a suffix after a cached prefix, a
                        # resume tail (schema 1: not modelled)
    kv_bytes_per_token: int = Field(gt=0)
    gpu_kv_tokens: int = Field(gt=0)
    host_kv_tokens: int = Field(ge=0)
    block_size: int = Field(gt=0)
    swap_in_ms_per_token: float = Field(ge=0)
    max_num_seqs: int = Field(gt=0)
    engine: EngineBehaviour = EngineBehaviour()
    provenance: dict[str, str] = {}   # figure -> where it comes from (measured, paper, fitted)

    @model_validator(mode='after')
    def _engine_needs_schema_2(self) -> Calibration:
        if self.schema_version == 1 and self.engine != EngineBehaviour():
            raise ValueError('an engine section needs schema_version: 2')
        # EngineBehaviour's own fields take inf (a bound of ge=0 only); here it is a latency.
        for name, value in self.engine.model_dump().items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f'engine.{name} must be a finite number, got {value}')
        return self

    def resume_tail_tokens(self, context_tokens: int) -> int:
        """Tokens a ``new_request_prefix_cache`` resume recomputes over a context of
        ``context_tokens``: those after the last full KV block the cache may return (it
        keeps at least one token to compute); 0 for ``kept_kv``."""
        if self.engine.resume == 'kept_kv' or context_tokens <= 0:
            return 0
        return context_tokens - self.cached_block_tokens(context_tokens)

    def cached_block_tokens(self, context_tokens: int) -> int:
        """Tokens of a context that a block-level prefix cache can return: its full KV
        blocks, less one token when it ends on a block boundary (the engine computes at least
        one token, for its logits)."""
        block = self.block_size
        return block * ((context_tokens - 1) // block) if context_tokens > 0 else 0

    def prefill_s(self, tokens: int) -> float:
        """One prefill iteration over ``tokens`` new tokens (piecewise linear, extrapolated)."""
        if tokens <= 0:
            return 0.0
        ms = piecewise_linear(tokens, self.prefill_ms.tokens, self.prefill_ms.ms)
        return max(ms, 0.0) / 1000.0        # a falling end segment extrapolates below zero

    def context_prefill_s(self, tokens: int, context_tokens: int) -> float:
        """What prefilling ``tokens`` new tokens costs beyond :meth:`prefill_s` when
        ``context_tokens`` precede them in the KV cache (they attend to those too)."""
        if tokens <= 0 or context_tokens <= 0:
            return 0.0
        return self.prefill_ms_per_context_token * tokens * context_tokens / 1000.0

    @property
    def iteration_overhead_s(self) -> float:
        return self.engine.iteration_overhead_ms / 1000.0

    @property
    def resume_overhead_s(self) -> float:
        """Host cost of re-admitting one resumed generation (new-request resumes only)."""
        return (self.engine.resume_overhead_ms / 1000.0
                if self.engine.resume == 'new_request_prefix_cache' else 0.0)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """One decode iteration of ``batch`` sequences holding ``context_tokens`` in total
        (the model's time: the engine's fixed cost per iteration is apart)."""
        if batch <= 0:
            return 0.0
        base = piecewise_linear(batch, self.decode_ms.batch, self.decode_ms.ms)
        extra = context_tokens - batch * self.decode_ms.reference_context_tokens
        # Never below zero: a curve measured on a busy machine may fall with the batch, and a
        # context shorter than the reference subtracts; a negative time would run the
        # simulated clock backwards.
        return max(base + self.decode_ms_per_context_token * extra, 0.0) / 1000.0

    def swap_in_s(self, tokens: int) -> float:
        return tokens * self.swap_in_ms_per_token / 1000.0


def piecewise_linear(x: float, xs: Sequence[int], ys: Sequence[float]) -> float:
    """Piecewise-linear interpolation, extrapolating the end segments (scalar, no numpy:
    this runs inside every scheduling decision)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def load_calibration(name_or_path: str | Path = DEFAULT_CALIBRATION) -> Calibration:
    """Load a bundled calibration by name or any calibration YAML by path.

    Raises:
        EngineError: the file is missing or cannot be read.
        EngineInputError: the file is too large, not UTF-8 YAML or invalid (the message names
            file and field).
    """
    candidate = Path(name_or_path)
    path = candidate if candidate.suffix in ('.yaml', '.yml') else (
        CALIBRATION_DIR / f'{candidate}.yaml')
    if not path.exists():
        known = ', '.join(sorted(p.stem for p in CALIBRATION_DIR.glob('*.yaml')))
        raise EngineError(f'no calibration {str(name_or_path)!r} ({path}); bundled: {known}')
    try:
        data = load_yaml(path, EngineInputError, YAML_FILE)
    except OSError as err:
        raise EngineError(f'{path}: cannot read calibration: {err.strerror}') from None
    try:
        return Calibration.model_validate(data)
    except ValidationError as err:
        problems = '; '.join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in err.errors())
        raise EngineInputError(str(path), f'invalid calibration: {problems}') from None
