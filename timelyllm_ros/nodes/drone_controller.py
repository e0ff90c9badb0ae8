"""drone_controller node: a robot controller for a Tello (see :mod:`.controller`)."""

from __future__ import annotations

from timelyllm_ros.nodes.controller import run


def main(args: list[str] | None = None) -> None:
    run('controller', 'tello', args)
