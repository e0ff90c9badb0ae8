"""Robot kinds are plug-ins: a new kind is one module plus a profile YAML.

The sketch below adds a ``boat``: its module (a fake in-memory backend and its
:class:`~timelyllm_ros.robots.kind.RobotKind`) and its profile are written into a fresh
directory, the module's directory is put on ``sys.path``, and nothing else is touched. The
profile loads, the factory opens the boat's backend, ``lrtrace profile`` drives it into a bag,
the service's task-class rule reads it, and the registry lists it.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from lrtrace.cli import main as lrtrace_main
from lrtrace.profiling import BACKENDS, DEFAULTS, profile_robot
from lrtrace.reader import read_bag
from timelyllm_ros.core.clock import SimClock, WallClock
from timelyllm_ros.errors import RobotError
from timelyllm_ros.language.profiles import (
    PROFILES_DIR,
    available_profiles,
    load_profile,
    load_profile_file,
)
from timelyllm_ros.robots import kind as kind_registry
from timelyllm_ros.robots.factory import open_robot
from timelyllm_ros.robots.kind import RobotKind, kind_of, register_kind, robot_kind, robot_kinds
from timelyllm_ros.robots.sim_backend import SimulatedBackend

BOAT_MODULE = '''
"""A boat: a fake in-memory backend (no hardware, no emulator process) and its robot kind."""

from timelyllm_ros.robots.backend import RobotBackend, wait_on
from timelyllm_ros.robots.kind import Robot, RobotKind, register_kind


class BoatBackend(RobotBackend):
    def __init__(self, profile, clock, time_scale):
        self.profile, self.clock, self.time_scale = profile, clock, time_scale
        self.connected = False
        self.performed = []

    def connect(self):
        self.connected = True

    def close(self):
        self.connected = False

    def supports(self, skill):
        return skill != 'radio'

    def perform(self, call):
        self.performed.append(call.text)
        model = self.profile.skill(call.skill).exec_time
        wait_on(self.clock, model.mean_s(call.args) * self.time_scale)


class BoatKind(RobotKind):
    name = 'boat'
    category = 'boat'
    backends = ('emulator',)
    profiling_defaults = {'grid': 3, 'repeats': 1, 'time_scale': 0.001}

    def task_class(self, urgency):
        return 'normal'

    def open(self, profile, backend, address, clock, options):
        boat = BoatBackend(profile, clock, options.time_scale)
        boat.connect()
        return Robot(boat, 'an in-memory boat; not hardware', 'memory',
                     meta={'emulator': 'BoatBackend'}, _closers=[boat.close])


KIND = register_kind(BoatKind())
'''

BOAT_PROFILE = {
    'name': 'boat',
    'kind': 'boat',
    'driver': 'boat_kind:BoatKind',
    'segment_generation_s': 0.1,
    'max_segment_tokens': 10,
    'max_tokens': 64,
    'exec_time_provenance': 'test figures, not measured',
    'skills': [
        {'name': 'sail', 'short': 'sl',
         'args': [{'name': 'distance', 'type': 'int', 'min': 10, 'max': 100, 'unit': 'm'}],
         'exec_time': {'kind': 'parametric', 'argument': 'distance',
                       'coefficients': [1.0, 0.1]}},
        {'name': 'anchor', 'short': 'an', 'exec_time': {'kind': 'constant', 'seconds': 2.0}},
        {'name': 'radio', 'short': 'rd', 'exec_time': {'kind': 'constant', 'seconds': 0.5}},
    ],
    'prompt': {'system': 'You plan for a boat.'},
}


@pytest.fixture
def boat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The new kind's two files, in a directory of their own on sys.path; the registry and
    sys.modules as they were afterwards."""
    kind_dir = tmp_path / 'new_kind'
    kind_dir.mkdir()
    (kind_dir / 'boat_kind.py').write_text(textwrap.dedent(BOAT_MODULE), encoding='utf-8')
    (kind_dir / 'boat.yaml').write_text(yaml.safe_dump(BOAT_PROFILE), encoding='utf-8')
    monkeypatch.syspath_prepend(str(kind_dir))
    monkeypatch.setattr(kind_registry, '_KINDS', dict(robot_kinds()))
    yield kind_dir
    sys.modules.pop('boat_kind', None)


def test_a_new_kind_is_one_module_and_a_profile(boat: Path, tmp_path: Path) -> None:
    assert sorted(p.name for p in boat.iterdir() if p.name != '__pycache__') == [
        'boat.yaml', 'boat_kind.py']
    assert 'boat' not in robot_kinds()           # not imported yet
    # the profile loads, by name from its directory and by path
    profile = load_profile('boat', boat)
    assert available_profiles(boat) == ['boat']
    assert load_profile_file(boat / 'boat.yaml') == profile
    assert (profile.kind, profile.driver) == ('boat', 'boat_kind:BoatKind')
    # its kind comes from the module the profile names, and the registry lists it
    kind = kind_of(profile)
    assert type(kind).__name__ == 'BoatKind' and kind is robot_kind('boat')
    assert robot_kinds()['boat'] is kind
    assert kind.task_class('urgent') == 'normal'
    # the factory opens its backend (and the generic simulated one)
    robot = open_robot(profile, 'emulator', None, WallClock())
    assert type(robot.backend).__name__ == 'BoatBackend' and robot.backend.connected
    assert robot.meta == {'emulator': 'BoatBackend'}
    robot.close()
    assert not robot.backend.connected
    simulated = open_robot(profile, 'sim', None, SimClock())
    assert isinstance(simulated.backend, SimulatedBackend)
    simulated.close()
    with pytest.raises(RobotError, match="'boat' has no real backend"):
        open_robot(profile, 'real', None, WallClock())
    # lrtrace profile drives it through the generic rig into a bag
    run = profile_robot(boat / 'boat.yaml', 'emulator', tmp_path / 'bag')
    assert (run.robot, run.grid, run.repeats, run.time_scale) == ('boat', 3, 1, 0.001)
    assert run.samples == {'sail': 3, 'anchor': 1}
    assert run.skipped == {'radio': 'not supported by BoatBackend'}
    bag = read_bag(tmp_path / 'bag')
    assert [s.skill for s in bag.skills] == ['sail', 'sail', 'sail', 'anchor']
    assert bag.info['emulator'] == 'BoatBackend' and bag.info['robot'] == 'boat'


def test_the_lrtrace_command_profiles_a_new_kind_by_its_profile_path(
        boat: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert lrtrace_main(['profile', '--robot', str(boat / 'boat.yaml'), '--backend',
                         'emulator', '--grid', '2', '--time-scale', '0.001',
                         '--out', str(tmp_path / 'bag')]) == 0
    out = capsys.readouterr().out
    assert 'profiled 2 skills of boat on backend emulator' in out
    assert 'skipped radio: not supported by BoatBackend' in out
    assert lrtrace_main(['profile', '--robot', str(boat / 'boat.yaml'), '--backend',
                         'djitellopy', '--out', str(tmp_path / 'bag2')]) == 1
    assert "backend 'djitellopy' drives the tello robot, not 'boat'" in capsys.readouterr().err


def test_the_bundled_kinds_drive_the_bundled_profiles() -> None:
    kinds = robot_kinds()
    assert {name: (k.category, k.backends) for name, k in kinds.items()}.items() >= {
        'chatbot': ('chatbot', ()), 'indy7': ('arm', ('emulator', 'real')),
        'tello': ('drone', ('emulator', 'real'))}.items()
    assert {name: kind_of(load_profile(name)).name for name in available_profiles()} == {
        'chatbot': 'chatbot', 'chatbot_paragraph': 'chatbot', 'indy7': 'indy7',
        'tello': 'tello'}
    # the service's rule: an arm's tasks are of class 'arm', the others' their urgency
    assert kinds['indy7'].task_class('urgent') == 'arm'
    assert kinds['tello'].task_class('urgent') == 'urgent'
    assert kinds['chatbot'].task_class('normal') == 'normal'
    assert BACKENDS == ('sim', 'emulator', 'djitellopy', 'indydcp3')
    assert DEFAULTS[('emulator', 'tello')] == {'grid': 6, 'repeats': 1, 'time_scale': 0.05}
    assert DEFAULTS[('emulator', 'indy7')] == {'grid': 6, 'repeats': 2, 'time_scale': 0.25}


def test_a_profile_of_another_name_finds_its_kind_by_category(tmp_path: Path) -> None:
    data = yaml.safe_load((PROFILES_DIR / 'tello.yaml').read_text(encoding='utf-8'))
    data['name'] = 'my_tello'
    path = tmp_path / 'my_tello.yaml'
    path.write_text(yaml.safe_dump(data), encoding='utf-8')
    assert kind_of(load_profile_file(path)).name == 'tello'


def _profile_with(tmp_path: Path, **fields: object) -> Path:
    path = tmp_path / 'odd.yaml'
    path.write_text(yaml.safe_dump({**BOAT_PROFILE, 'name': 'odd', **fields}),
                    encoding='utf-8')
    return path


def test_unknown_kinds_and_drivers_are_clear_errors(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kind_registry, '_KINDS', dict(robot_kinds()))
    nobody = load_profile_file(_profile_with(tmp_path, kind='submarine', driver=None))
    with pytest.raises(RobotError, match="no robot kind serves kind 'submarine'.*driver:"):
        kind_of(nobody)
    with pytest.raises(RobotError, match="no robot kind serves kind 'submarine'"):
        open_robot(nobody, 'emulator', None, WallClock())
    # the simulated backend is generic: any profile has it
    open_robot(nobody, 'sim', None, SimClock()).close()
    missing = load_profile_file(_profile_with(tmp_path, driver='no_such_module:Kind'))
    with pytest.raises(RobotError, match="cannot load robot kind 'no_such_module:Kind'"):
        kind_of(missing)
    wrong = load_profile_file(_profile_with(tmp_path, kind='drone', driver='indy7'))
    with pytest.raises(RobotError, match="drives 'arm' robots, the profile is a 'drone'"):
        kind_of(wrong)
    not_a_kind = load_profile_file(_profile_with(tmp_path, driver='pathlib:Path'))
    with pytest.raises(RobotError, match='is not a RobotKind subclass'):
        kind_of(not_a_kind)
    with pytest.raises(RobotError, match="unknown robot kind 'warp'"):
        robot_kind('warp')


def test_registering_checks_the_kind() -> None:
    class Nameless(RobotKind):
        category = 'x'

    class Wheels(RobotKind):
        name, category, backends = 'wheels', 'rover', ('simulator',)

    class OtherTello(RobotKind):
        name, category = 'tello', 'drone'

    with pytest.raises(RobotError, match='needs a name and a category'):
        register_kind(Nameless())
    with pytest.raises(RobotError, match=r"unknown backends \['simulator'\]"):
        register_kind(Wheels())
    robot_kinds()
    with pytest.raises(RobotError, match="'tello' is registered already by"):
        register_kind(OtherTello())


def test_profile_kind_is_an_open_category_of_plain_names(tmp_path: Path) -> None:
    assert load_profile_file(_profile_with(tmp_path, kind='submarine')).kind == 'submarine'
    for bad in ('Drone', 'two words', '../x', ''):
        with pytest.raises(Exception, match='kind'):
            load_profile_file(_profile_with(tmp_path, kind=bad))
    with pytest.raises(Exception, match='driver'):
        load_profile_file(_profile_with(tmp_path, driver='a b:c'))
