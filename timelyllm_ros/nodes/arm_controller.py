"""arm_controller node: a robot controller for an Indy7 arm (see :mod:`.controller`)."""

from __future__ import annotations

from timelyllm_ros.nodes.controller import run


def main(args: list[str] | None = None) -> None:
    run('controller', 'indy7', args)
