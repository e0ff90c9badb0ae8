"""Test factories: task specs and a scheduler over the simulated engine on a virtual clock,
and the benchmark scripts as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import TaskSpec
from timelyllm_ros.core.scheduler import Scheduler, SchedulerConfig
from timelyllm_ros.core.tuf import Tuf, tuf_for_class
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.language.traces import approx_tokenize
from timelyllm_ros.policies import create_policy


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


def tiny_calibration(**overrides: object):  # -> Calibration
    """A small, round-numbered latency model: prefill 0.1 ms/token, decode 20 ms at batch 1 and
    +10 ms per extra sequence (no context term), 10 GPU blocks and 10 host blocks of 16 tokens,
    swap-in 0.01 ms/token, at most 4 sequences."""
    from timelyllm_ros.engines.calibration import Calibration

    data: dict[str, object] = {
        'model': 'tiny', 'gpu': 'test', 'source': 'hand-made for tests',
        'prefill_ms': {'tokens': [0, 1000], 'ms': [0.0, 100.0]},
        'decode_ms': {'reference_context_tokens': 0, 'batch': [1, 2], 'ms': [20.0, 30.0]},
        'decode_ms_per_context_token': 0.0,
        'kv_bytes_per_token': 1,
        'gpu_kv_tokens': 160,
        'host_kv_tokens': 160,
        'block_size': 16,
        'swap_in_ms_per_token': 0.01,
        'max_num_seqs': 4,
    }
    data.update(overrides)
    return Calibration.model_validate(data)


BENCHMARKS = Path(__file__).resolve().parents[1] / 'benchmarks'


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported from its path (``benchmarks/`` is not a package) and
    registered in ``sys.modules`` (its dataclasses need that)."""
    spec = importlib.util.spec_from_file_location(f'{name}_benchmark', BENCHMARKS / f'{name}.py')
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
