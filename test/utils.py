"""Test factories: task specs and a scheduler over the simulated engine on a virtual clock."""

from __future__ import annotations

from lrtrace.traces import approx_tokenize
from timelyllm_ros.clock import SimClock
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.policies import create_policy
from timelyllm_ros.request import TaskSpec
from timelyllm_ros.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.tuf import Tuf, tuf_for_class


def make_spec(task_id: str = 't0', profile: str = 'tello', task_class: str = 'normal',
              arrival: float = 0.0, plan: str | None = 'mf(50);tc(90)', tuf: Tuf | None = None,
              prompt_tokens: int = 1331, task_tokens: int = 0,
              skill_times: tuple[tuple[str, float], ...] | None = None,
              task: str = 'fly forward and turn', robot_id: str | None = None) -> TaskSpec:
    """A plan request whose simulated output is ``plan`` split into token-sized pieces."""
    return TaskSpec(
        task_id=task_id, robot_id=robot_id or f'{profile}-{task_id}', profile=profile,
        task_class=task_class, task_type='T0',
        tuf=tuf if tuf is not None else tuf_for_class(task_class),
        arrival_time=arrival, task=task, prompt_tokens=prompt_tokens, task_tokens=task_tokens,
        script=approx_tokenize(plan) if plan is not None else None, skill_times=skill_times,
    )


def make_scheduler(policy: str = 'timelyllm', config: SchedulerConfig | None = None,
                   **engine_kwargs: object) -> tuple[Scheduler, SimClock, SimulatedEngine]:
    """A scheduler with the given policy over a fresh SimulatedEngine and SimClock."""
    clock = SimClock()
    engine = SimulatedEngine(**engine_kwargs)  # type: ignore[arg-type]
    scheduler = Scheduler(create_policy(policy), engine, clock, config)
    return scheduler, clock, engine
