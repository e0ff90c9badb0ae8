"""Inference engines behind one interface; heavy engines are imported only when created."""

from __future__ import annotations

from timelyllm_ros.engines.base import Engine, EngineRequest, StepResult
from timelyllm_ros.errors import EngineError

ENGINES = ('sim',)


def create_engine(name: str = 'sim', **options: object) -> Engine:
    """Build an engine by name (``sim``: the calibrated simulator).

    Raises:
        EngineError: unknown engine name.
    """
    if name == 'sim':
        from timelyllm_ros.engines.calibration import load_calibration
        from timelyllm_ros.engines.sim import SimulatedEngine

        calibration = options.pop('calibration', None)
        if isinstance(calibration, str):
            options['calibration'] = load_calibration(calibration)
        elif calibration is not None:
            options['calibration'] = calibration
        return SimulatedEngine(**options)  # type: ignore[arg-type]
    raise EngineError(f'unknown engine {name!r}; available: {", ".join(ENGINES)}')


__all__ = ['ENGINES', 'Engine', 'EngineRequest', 'StepResult', 'create_engine']
