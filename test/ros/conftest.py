"""The ROS tests keep their nodes' state (task journals, logs) out of the user's ~/.ros."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope='session', autouse=True)
def ros_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``ROS_HOME`` in a fresh folder for the session: in-process nodes and the ``ros2 run``
    processes the tests start read their journals from there, never a previous run's."""
    previous = os.environ.get('ROS_HOME')
    home = str(tmp_path_factory.mktemp('ros_home'))
    os.environ['ROS_HOME'] = home
    yield home
    if previous is None:
        os.environ.pop('ROS_HOME', None)
    else:
        os.environ['ROS_HOME'] = previous
