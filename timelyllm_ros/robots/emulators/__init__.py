"""Loopback emulators of robots, for testing the real vendor clients without hardware.

* :class:`~timelyllm_ros.robots.emulators.tello.TelloEmulator` -- the Tello SDK 2.0 UDP text
  protocol, for the unmodified ``djitellopy`` client.
* :class:`~timelyllm_ros.robots.emulators.indy7.Indy7Emulator` -- an IndyDCP3 gRPC server, for
  the unmodified ``neuromeka`` client.

The emulators are imported lazily (``from timelyllm_ros.robots.emulators import TelloEmulator``
loads only the Tello one), so one emulator's dependencies are never needed for the other.
"""

from __future__ import annotations

import importlib

_MODULES = {'TelloEmulator': 'tello', 'Indy7Emulator': 'indy7'}

__all__ = sorted(_MODULES)


def __getattr__(name: str) -> object:
    """Import an emulator class on first access."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    return getattr(importlib.import_module(f'{__name__}.{module}'), name)
