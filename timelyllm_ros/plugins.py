"""Plug-ins named ``'package.module:Name'`` (policies, engines, robot kinds): one way to load
what such a name stands for, and to refuse it with the reason."""

from __future__ import annotations

import importlib
from typing import Any

from timelyllm_ros.errors import TimelyError


def load_named(spec: str, what: str, error: type[TimelyError]) -> object:
    """What ``'package.module:Name'`` names (the module is imported).

    Raises:
        error: the module cannot be imported or has no such name (``what`` says what was
            asked for: ``'policy'``, ``'engine'``, ``'robot kind'``).
    """
    module_name, _, name = spec.partition(':')
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise error(f'cannot load {what} {spec!r}: {err}') from None


def load_class(spec: str, base: type, what: str, error: type[TimelyError]) -> type[Any]:
    """The subclass of ``base`` that ``'package.module:Class'`` names.

    Raises:
        error: it cannot be loaded (:func:`load_named`) or is no subclass of ``base``.
    """
    found = load_named(spec, what, error)
    if not (isinstance(found, type) and issubclass(found, base)):
        article = 'an' if base.__name__[0] in 'AEIOU' else 'a'
        raise error(f'{spec!r} is not {article} {base.__name__} subclass')
    return found
