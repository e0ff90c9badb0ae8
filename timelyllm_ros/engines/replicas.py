"""Simulated replicas: N calibrated engines behind one queue and one scheduler (issue 30).

A fleet that outgrows one GPU is served by several replicas of the engine. The pool is an
:class:`~timelyllm_ros.engines.base.Engine`, so the scheduler and every policy run unchanged:

* a generation is placed on a replica when it first runs and stays there for its life: its KV
  is there (affinity); every later call about it goes to that replica;
* a new generation goes to the replica with the most free batch slots, then one that already
  served its prompt prefix (its robot kind's: cached there), then the fewest running, then the
  lowest index (:meth:`SimulatedReplicas.placement`); load comes first because a cold prefix
  costs one prompt prefill per replica and robot kind, once. A goal whose utility ends soon
  (``soon_s``) goes first to a replica with room where its first segment would be done
  soonest (its next iteration's start, then ``segment_tokens`` decode steps at its batch);
* replicas iterate side by side, each at its own pace: an iteration is timed when it starts
  (:meth:`~timelyllm_ros.engines.sim.SimulatedEngine.next_iteration`) and run when it ends,
  with the replica's state then; a step hands out the replica (or replicas) whose iteration
  ends first, its ``duration_s`` the time since the previous step and its ``iteration_s`` the
  iteration's own length. A generation admitted to a replica in the middle of its iteration
  gets that iteration's token, one paused in the middle does not: at most one iteration early
  or late, and nothing generated is lost;
* admission asks the replica a generation would go to (``can_run``, ``run_cost_s``), and the
  latency-guided test weighs that replica's batch only (:meth:`SimulatedReplicas.cohort`); a
  generation that replica refuses goes to its next best one and is asked again
  (:meth:`SimulatedReplicas.place_elsewhere`, each replica once until the next iteration)
  before the scheduler's decision stops;
  the pool's decode-step model is that of a replica holding an even share of the batch.

With one replica the pool is that replica, iteration for iteration.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from timelyllm_ros.engines.base import (
    Capability,
    CostModel,
    Engine,
    EngineBehaviour,
    EngineRequest,
    EngineStats,
    EvictTo,
    KvAccounting,
    PlanScript,
    ReplicaState,
    StepResult,
)
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.errors import EngineError


def replica_rank(index: int, *, free: int, cached: bool, running: int,
                 done_s: float = 0.0) -> tuple[bool, float, int, bool, int, int]:
    """Where a new generation goes, as a sort key (the least first): a replica with a free
    batch slot, then the soonest its first segment would be done there (``done_s``; 0 where
    not estimated), the most free slots, one that has served its prompt prefix, the fewest
    running, the lowest index. The simulated pool and the pool of vLLM servers share it."""
    return (free <= 0, done_s, -free, not cached, running, index)


class SimulatedReplicas(Engine):
    """N simulated engines of the same settings, as one."""

    def __init__(self, replicas: Sequence[SimulatedEngine], soon_s: float = 1.0,
                 segment_tokens: int = 10, request_latency_s: float = 0.0) -> None:
        """Args:
            replicas: the engines, of the same settings.
            soon_s: a request whose zero-utility time is at most this goes to the replica
                where its first segment would be done soonest; the others to the most room.
                1 s sends urgent goals (0.5 s) that way and normal ones (1.5 s) by room. On
                benchmarks/overload.py (1000 robots per replica, seeds 0-1) the floored urgent
                utility was 0.331 / 0.208 / 0.363 at 2 / 4 / 8 replicas against 0.173 / 0.219 /
                0.553 by room alone (seeds 0-2, 0-2, 0), throughput 2.0x / 4.1x / 8.4x one
                replica's either way.
            segment_tokens: tokens of a first segment, for when it would be done on a
                replica (the drones' l_max, the paper's 10).
            request_latency_s: the network's share of each segment request (the vllm-server
                engine's HTTP requests: the request's way to its replica and the first
                token's way back): a generation that runs holds its batch slot and KV but
                joins its replica's iterations only this long after.
        """
        if not replicas:
            raise EngineError('a replica pool needs at least one replica')
        if request_latency_s < 0:
            raise EngineError(f'request_latency_s must be >= 0, got {request_latency_s}')
        self.request_latency_s = request_latency_s
        self._avoid: dict[str, set[int]] = {}     # request id -> replicas that refused it
                                                  # since the last iteration
        self._arrives: dict[str, float] = {}      # request id -> when its segment request
                                                  # reaches its replica (in flight until then)
        self.replicas = tuple(replicas)
        self.soon_s = soon_s
        self.segment_tokens = segment_tokens
        self._clock = 0.0                          # the pool's own time (differences matter)
        self._ends: dict[int, tuple[float, float]] = {}   # replica -> (start, length) of its
                                                          # iteration under way
        self.lookahead_tokens = max(r.lookahead_tokens for r in self.replicas)
        self._requests: dict[str, EngineRequest] = {}
        self._registered: dict[str, int] = {}      # request id -> the replica that knows it
        self._ran: set[str] = set()                # ... and holds its KV: its home for life
        self._prefixes: list[set[str]] = [set() for _ in self.replicas]   # prefix ids served

    # -- placement --------------------------------------------------------------------------
    def placement(self, request_id: str) -> int:
        """The replica a generation runs on: its home once it has one, else where it would go
        now (the module docstring's rule; asking changes nothing)."""
        if request_id in self._ran:
            return self._registered[request_id]
        request = self._known(request_id)
        avoid = self._avoid.get(request_id, ())
        prefix = request.prefix_id
        soon = request.zero_utility_s is not None and request.zero_utility_s <= self.soon_s

        def rank(index: int) -> tuple[bool, float, int, bool, int, int]:
            replica = self.replicas[index]
            running = replica.num_running
            cached = prefix is not None and prefix in self._prefixes[index]
            done = 0.0
            if soon:          # when its segment could be done there: joined at the next
                under_way = self._ends.get(index)       # iteration, then decoded in that batch
                start = sum(under_way) if under_way is not None else self._clock
                done = start + self.segment_tokens * replica.decode_step_s(running + 1)
            return replica_rank(index, free=replica.max_num_seqs - running, cached=cached,
                                running=running, done_s=done)

        return min((i for i in range(len(self.replicas)) if i not in avoid), key=rank)

    def place_elsewhere(self, request_id: str) -> bool:
        """A generation that has not run yet goes to its next best replica for the rest of
        this decision (until the pool's next iteration), if one is left."""
        if request_id in self._ran:
            return False
        avoid = self._avoid.setdefault(request_id, set())
        if len(avoid) + 1 >= len(self.replicas):
            return False
        avoid.add(self.placement(request_id))
        return True

    def replica_of(self, request_id: str) -> Engine:
        """The replica a generation runs (or would run) on."""
        return self.replicas[self.placement(request_id)]

    def _known(self, request_id: str) -> EngineRequest:
        request = self._requests.get(request_id)
        if request is None:
            raise EngineError(f'unknown request {request_id!r}')
        return request

    def _placed(self, request_id: str) -> Engine:
        """The replica of the generation's placement, with the request registered there: its
        home once it has run. One that has not run yet follows its placement (asked about
        before, it may have been registered on another replica, which never held its KV)."""
        index = self.placement(request_id)
        current = self._registered.get(request_id)
        if current != index:
            request = self._known(request_id)
            if current is not None:
                self.replicas[current].release(request_id)
            self.replicas[index].register(request)
            self._registered[request_id] = index
        return self.replicas[index]

    # -- the engine interface ---------------------------------------------------------------
    def register(self, request: EngineRequest) -> None:
        if request.request_id in self._requests:
            raise EngineError(f'request {request.request_id!r} is already registered')
        self._requests[request.request_id] = request

    def can_run(self, request_id: str) -> bool:
        return self._placed(request_id).can_run(request_id)

    def fits_when_idle(self, request_id: str) -> bool:
        return self._placed(request_id).fits_when_idle(request_id)

    def run_cost_s(self, request_id: str) -> float:
        return self._placed(request_id).run_cost_s(request_id)

    def run(self, request_id: str) -> None:
        replica = self._placed(request_id)
        joining = request_id not in replica.running
        replica.run(request_id)
        self._ran.add(request_id)
        if joining and self.request_latency_s > 0:
            self._arrives[request_id] = self._clock + self.request_latency_s
        prefix = self._requests[request_id].prefix_id
        if prefix is not None:
            self._prefixes[self._registered[request_id]].add(prefix)

    def pause(self, request_id: str) -> None:
        self._placed(request_id).pause(request_id)
        self._arrives.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self._known(request_id)
        index = self._registered.pop(request_id, None)
        if index is not None:
            self.replicas[index].release(request_id)
        self._ran.discard(request_id)
        self._arrives.pop(request_id, None)
        self._requests.pop(request_id, None)

    def evict(self, request_id: str, to: EvictTo) -> None:
        self._placed(request_id).evict(request_id, to)

    def compress_kv(self, request_id: str, evict_ratio: float) -> None:
        self._placed(request_id).compress_kv(request_id, evict_ratio)

    def step(self, only: Collection[str] | None = None) -> StepResult:
        self._avoid.clear()
        self._arrives = {r: t for r, t in self._arrives.items() if t > self._clock}
        for index, replica in enumerate(self.replicas):
            if index not in self._ends and replica.running:
                mask = self._mask(replica, only)
                if mask is None or mask:
                    self._ends[index] = (self._clock, replica.next_iteration(mask).duration_s)
        if not self._ends:
            if not self._arrives:
                return StepResult(duration_s=0.0)
            # every running generation's request is still on its way: wait for the first
            arrival = min(self._arrives.values())
            gap, self._clock = arrival - self._clock, arrival
            return StepResult(duration_s=gap)
        end = min(start + length for start, length in self._ends.values())
        ending = sorted(i for i, (start, length) in self._ends.items() if start + length == end)
        # the time since the previous step: an iteration that began then is exactly its length
        gap = min(length if start == self._clock else end - self._clock
                  for start, length in (self._ends[i] for i in ending))
        results = []
        for index in ending:
            del self._ends[index]
            replica = self.replicas[index]
            if replica.running:     # its generations may all have left in the meantime
                results.append(replica.step(self._mask(replica, only)))
        self._clock = end
        merged = StepResult(
            duration_s=gap,
            iteration_s=max((r.duration_s for r in results), default=gap),
            preempted=tuple(p for r in results for p in r.preempted),
            prefill_tokens=sum(r.prefill_tokens for r in results),
            prefix_cached_tokens=sum(r.prefix_cached_tokens for r in results),
            batch_size=sum(r.batch_size for r in results))
        for result in results:
            merged.text.update(result.text)
            merged.token_ids.update(result.token_ids)
            merged.finished.update(result.finished)
            merged.failed.update(result.failed)
        return merged

    def _mask(self, replica: Engine, only: Collection[str] | None) -> list[str] | None:
        """A decode mask's part on one replica, without the generations whose request has
        not reached it yet (None: no mask; empty: none of its own)."""
        if only is None and not self._arrives:
            return None
        return [r for r in replica.running
                if (only is None or r in only) and r not in self._arrives]

    def decode_step_s(self, batch_size: int) -> float:
        share = max(1, math.ceil(batch_size / len(self.replicas)))
        return max(replica.decode_step_s(share) for replica in self.replicas)

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(r for replica in self.replicas for r in replica.running)

    @property
    def max_num_seqs(self) -> int:
        return sum(replica.max_num_seqs for replica in self.replicas)

    def stats(self) -> EngineStats:
        each = [replica.stats() for replica in self.replicas]
        first = each[0]
        return EngineStats(
            model=first.model, hardware=f'{len(each)} x {first.hardware}',
            steps=max(s.steps for s in each), busy_s=max(s.busy_s for s in each),
            kv_capacity_tokens=sum(s.kv_capacity_tokens for s in each),
            kv_bytes_per_token=first.kv_bytes_per_token,
            swap_bytes=sum(s.swap_bytes for s in each), swap_s=sum(s.swap_s for s in each),
            grammar_s=sum(s.grammar_s for s in each), model_s=sum(s.model_s for s in each),
            preemptions=sum(s.preemptions for s in each))

    def behaviour(self) -> EngineBehaviour:
        return self.replicas[0].behaviour()

    @property
    def kv_block_size(self) -> int:
        return self.replicas[0].kv_block_size

    def reset_prefix_cache(self) -> None:
        for replica in self.replicas:
            replica.reset_prefix_cache()
        for served in self._prefixes:
            served.clear()

    def warmup(self) -> None:
        for replica in self.replicas:
            replica.warmup()

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def supports(self, capability: Capability) -> bool:
        return all(replica.supports(capability) for replica in self.replicas)

    def count_tokens(self, text: str) -> int:
        return self.replicas[0].count_tokens(text)

    def token_ids(self, request_id: str) -> tuple[int, ...]:
        return self._placed(request_id).token_ids(request_id)

    def scripted_plan(self, robot_kind: str, task: str, task_class: str) -> PlanScript | None:
        return self.replicas[0].scripted_plan(robot_kind, task, task_class)

    def kv_accounting(self) -> KvAccounting | None:
        """None: the pool's memory is N separate memories (a policy reading one block count
        would misjudge where a generation fits; :meth:`can_run` asks the right replica)."""
        return None

    def cost_model(self) -> CostModel | None:
        return self.replicas[0].cost_model()

    def kv_room_tokens(self) -> int:
        """The least of the replicas' rooms: what new contexts can fill wherever they go (a
        sum would count room on one replica for contexts placed on another)."""
        return min(replica.kv_room_tokens() for replica in self.replicas)

    def context_tokens(self, request_id: str) -> int:
        """On its replica once it has one; else as a replica would hold it (they share one
        calibration, so one that has not run yet costs the same on any)."""
        index = self._registered.get(request_id)
        if index is not None:
            return self.replicas[index].context_tokens(request_id)
        return self.replicas[0].new_context_tokens(self._known(request_id))

    def replica_states(self) -> tuple[ReplicaState, ...]:
        return tuple(ReplicaState(str(index), running=replica.num_running)
                     for index, replica in enumerate(self.replicas))

    def cohort(self, request_id: str) -> Engine | None:
        """The replica the generation runs or would run on: its iterations are the ones a
        latency test must protect, not the other replicas'."""
        return self.replica_of(request_id)
