"""An engine wrapper that fails on purpose: fault campaigns and chaos tests of a fleet.

:class:`FaultInjectingEngine` forwards every call to a real engine and, before forwarding,
raises with a seeded probability per call kind (``register``, ``run``, ``step``, ``pause``,
``release``, ``evict``, ``compress_kv``, ``can_run``). The raised exception is not an
:class:`~timelyllm_ros.errors.EngineError` by default, because real backends raise whatever
their library raises (``RuntimeError`` from CUDA, ``MemoryError``, ``ValueError``...). A call
that raises has no effect on the inner engine, so the wrapper models a call that failed
cleanly; the scheduler must then keep its own state consistent.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from timelyllm_ros.engines.base import (
    Capability,
    CostModel,
    Engine,
    EngineRequest,
    EngineStats,
    EvictTo,
    KvAccounting,
    PlanScript,
    ReplicaState,
    StepResult,
)

FAULTABLE = ('register', 'can_run', 'run', 'pause', 'release', 'step', 'evict', 'compress_kv')


class InjectedFault(RuntimeError):
    """The failure a :class:`FaultInjectingEngine` raises."""


class FaultInjectingEngine(Engine):
    """Wraps an engine; each call kind fails with its own probability (seeded)."""

    def __init__(self, inner: Engine, rates: Mapping[str, float], seed: int = 0,
                 error: type[Exception] = InjectedFault, record: bool = False) -> None:
        """Args:
            inner: the engine that does the work.
            rates: probability of a fault per call kind (see ``FAULTABLE``).
            seed: seeds the fault draws.
            error: the exception type raised.
            record: keep every text piece each request produced (``transcript``), to compare
                what was dispatched with what was generated.
        """
        unknown = set(rates) - set(FAULTABLE)
        if unknown:
            raise ValueError(f'unknown engine calls {sorted(unknown)}; faultable: {FAULTABLE}')
        if any(not 0.0 <= p <= 1.0 for p in rates.values()):
            raise ValueError('fault rates are probabilities in [0, 1]')
        self.inner = inner
        self.rates = dict(rates)
        self.error = error
        self.injected: dict[str, int] = dict.fromkeys(FAULTABLE, 0)
        self.transcript: dict[str, list[str]] | None = {} if record else None
        self._rng = np.random.default_rng(seed)

    def _maybe_fail(self, call: str, request_id: str = '') -> None:
        rate = self.rates.get(call, 0.0)
        if rate and self._rng.random() < rate:
            self.injected[call] += 1
            raise self.error(f'injected fault in {call}({request_id})')

    @property
    def capabilities(self) -> frozenset[Capability]:  # type: ignore[override]  # the inner's
        return self.inner.capabilities

    @property
    def lookahead_tokens(self) -> int:  # type: ignore[override]  # the inner engine's
        return self.inner.lookahead_tokens

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def warmup(self) -> None:
        self.inner.warmup()

    def close(self) -> None:
        self.inner.close()

    def kv_accounting(self) -> KvAccounting | None:
        return self.inner.kv_accounting()

    def cost_model(self) -> CostModel | None:
        return self.inner.cost_model()

    def kv_room_tokens(self) -> int | None:
        return self.inner.kv_room_tokens()

    def context_tokens(self, request_id: str) -> int | None:
        return self.inner.context_tokens(request_id)

    def cohort(self, request_id: str) -> Engine | None:
        return self.inner.cohort(request_id)

    def place_elsewhere(self, request_id: str) -> bool:
        return self.inner.place_elsewhere(request_id)

    def replica_states(self) -> tuple[ReplicaState, ...]:
        return self.inner.replica_states()

    def scripted_plan(self, robot_kind: str, task: str, task_class: str) -> PlanScript | None:
        return self.inner.scripted_plan(robot_kind, task, task_class)

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)

    def token_ids(self, request_id: str) -> tuple[int, ...]:
        return self.inner.token_ids(request_id)

    def prepare_request(self, request: EngineRequest) -> None:
        self.inner.prepare_request(request)     # raises nothing: faults come at register

    def register(self, request: EngineRequest) -> None:
        self._maybe_fail('register', request.request_id)
        self.inner.register(request)

    def can_run(self, request_id: str) -> bool:
        self._maybe_fail('can_run', request_id)
        return self.inner.can_run(request_id)

    def fits_when_idle(self, request_id: str) -> bool:
        self._maybe_fail('can_run', request_id)
        return self.inner.fits_when_idle(request_id)

    def run_cost_s(self, request_id: str) -> float:
        return self.inner.run_cost_s(request_id)

    def run(self, request_id: str) -> None:
        self._maybe_fail('run', request_id)
        self.inner.run(request_id)

    def pause(self, request_id: str) -> None:
        self._maybe_fail('pause', request_id)
        self.inner.pause(request_id)

    def release(self, request_id: str) -> None:
        self._maybe_fail('release', request_id)
        self.inner.release(request_id)

    def step(self, only: Collection[str] | None = None) -> StepResult:
        self._maybe_fail('step')
        result = self.inner.step(only)
        if self.transcript is not None:
            for request_id, piece in result.text.items():
                self.transcript.setdefault(request_id, []).append(piece)
        return result

    def evict(self, request_id: str, to: EvictTo) -> None:
        self._maybe_fail('evict', request_id)
        self.inner.evict(request_id, to)

    def compress_kv(self, request_id: str, evict_ratio: float) -> None:
        self._maybe_fail('compress_kv', request_id)
        self.inner.compress_kv(request_id, evict_ratio)

    def decode_step_s(self, batch_size: int) -> float:
        return self.inner.decode_step_s(batch_size)

    @property
    def running(self) -> tuple[str, ...]:
        return self.inner.running

    @property
    def max_num_seqs(self) -> int:
        return self.inner.max_num_seqs
