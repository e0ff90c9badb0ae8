"""The layer table of ARCHITECTURE.md, enforced on every import of both packages.

* Every import points down the table (a module imports its own layer or lower ones), lazy
  imports inside functions included; ``timelyllm_ros`` never imports ``lrtrace``, and
  ``lrtrace`` imports only public ``timelyllm_ros`` modules.
* L0–L4 never import ROS 2 (rclpy, launch, the generated interfaces); vendor libraries
  (djitellopy, neuromeka, grpc, torch, vllm, llama_cpp) are imported only inside the module that
  wraps them, and only when it is used (inside a function), so ``import timelyllm_ros.<x>``
  stays light.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lrtrace
import timelyllm_ros

PACKAGES = (timelyllm_ros, lrtrace)

LAYERS: dict[str, int] = {
    # L0: plain data and primitives
    'timelyllm_ros': 0, 'timelyllm_ros.errors': 0, 'timelyllm_ros.safe_files': 0,
    'timelyllm_ros.plugins': 0,
    'timelyllm_ros.core.clock': 0, 'timelyllm_ros.core.tuf': 0, 'timelyllm_ros.core.request': 0,
    'timelyllm_ros.core.events': 0, 'timelyllm_ros.language.plan': 0,
    # L1: the robots' plan language, execution times, goals, traces and workloads
    'timelyllm_ros.language': 1, 'timelyllm_ros.core.task_record': 1,
    'timelyllm_ros.live.goals': 1, 'timelyllm_ros.evaluation.workloads': 1,
    # L2: ranking and admission, and the engine interface policies read
    'timelyllm_ros.core.queue': 2, 'timelyllm_ros.core.priority': 2,
    'timelyllm_ros.core.running': 2, 'timelyllm_ros.core.admission': 2,
    'timelyllm_ros.core.predictors': 2, 'timelyllm_ros.core.plan_requests': 2,
    'timelyllm_ros.policies': 2, 'timelyllm_ros.engines.base': 2,
    # L3: the scheduler loop, the engines, the robots
    'timelyllm_ros.core.scheduler': 3, 'timelyllm_ros.engines': 3, 'timelyllm_ros.robots': 3,
    # L4: running it: live service, simulation, benchmarks, tools, LRTrace
    'timelyllm_ros.live': 4, 'timelyllm_ros.evaluation': 4, 'lrtrace': 4,
    # L5: entry points: command lines and ROS nodes
    'timelyllm_ros.cli': 5, 'timelyllm_ros.__main__': 5, 'timelyllm_ros.nodes': 5,
    'lrtrace.cli': 5, 'lrtrace.__main__': 5, 'lrtrace.nodes': 5,
}
ROS_MODULES = ('timelyllm_ros.nodes', 'lrtrace.nodes')   # need rclpy: L5 only
NOT_FOR_LRTRACE = ('timelyllm_ros.cli', 'timelyllm_ros.__main__')
ROS_LIBRARIES = ('rclpy', 'launch', 'launch_ros', 'rosidl_runtime_py', 'std_msgs',
                 'rcl_interfaces', 'lifecycle_msgs', 'action_msgs', 'builtin_interfaces',
                 'timelyllm_ros.msg', 'timelyllm_ros.action')
VENDOR_OWNERS = {
    'djitellopy': ('timelyllm_ros.robots.tello', 'timelyllm_ros.robots.emulators.tello'),
    'neuromeka': ('timelyllm_ros.robots.indy7', 'timelyllm_ros.robots.emulators.indy7'),
    'grpc': ('timelyllm_ros.robots.indy7', 'timelyllm_ros.robots.emulators.indy7'),
    'torch': ('timelyllm_ros.engines',),
    'vllm': ('timelyllm_ros.engines.vllm_engine',),
    'llama_cpp': ('timelyllm_ros.engines.llamacpp',),
    'llguidance': ('timelyllm_ros.engines.constraint',),
    'transformers': ('timelyllm_ros.engines',),
    'httpx': ('timelyllm_ros.engines.vllm_server',),
    'prometheus_client': ('timelyllm_ros.engines.vllm_server',),
}


@dataclass(frozen=True)
class Import:
    importer: str          # dotted module name
    target: str            # dotted name of the imported module
    module_level: bool


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + '.')


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        root = Path(package.__path__[0])
        for path in root.rglob('*.py'):
            parts = path.relative_to(root.parent).with_suffix('').parts
            name = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
            modules[name] = path
    return modules


MODULES = _modules()


def _imports() -> Iterator[Import]:
    """Every import of both packages; ``from package import name`` imports ``package.name``
    when that is a module."""
    for importer, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding='utf-8'))
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f'{importer}: relative import'
                base = node.module or ''
                targets = [f'{base}.{a.name}' if f'{base}.{a.name}' in MODULES else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                yield Import(importer, target, id(node) in top_level)


IMPORTS = list(_imports())


def layer_of(module: str) -> int:
    parts = module.split('.')
    for end in range(len(parts), 0, -1):
        layer = LAYERS.get('.'.join(parts[:end]))
        if layer is not None:
            return layer
    raise AssertionError(f'{module} is in no layer: add it to LAYERS and ARCHITECTURE.md')


def test_every_module_has_a_layer():
    assert {m: layer_of(m) for m in MODULES}


def upward(imports: list[Import]) -> list[str]:
    """The imports that point up the table, as ``importer (Lx) -> target (Ly)``."""
    return sorted({f'{i.importer} (L{layer_of(i.importer)}) -> {i.target} '
                   f'(L{layer_of(i.target)})'
                   for i in imports if i.target in MODULES or i.target in LAYERS
                   if layer_of(i.target) > layer_of(i.importer)})


def test_no_import_points_up_the_layer_table():
    assert upward(IMPORTS) == []


def test_timelyllm_ros_never_imports_lrtrace():
    assert [i for i in IMPORTS if _within(i.importer, 'timelyllm_ros')
            and _within(i.target, 'lrtrace')] == []


def test_lrtrace_uses_only_public_timelyllm_ros_modules():
    private = [i for i in IMPORTS if _within(i.importer, 'lrtrace')
               and _within(i.target, 'timelyllm_ros')
               and (any(_within(i.target, m) for m in NOT_FOR_LRTRACE)
                    or any(part.startswith('_') for part in i.target.split('.')))]
    assert private == []


def test_the_check_reports_upward_imports_and_allows_downward_ones():
    assert upward([Import('timelyllm_ros.core.scheduler', 'timelyllm_ros.live.service', False),
                   Import('timelyllm_ros.policies.semantic', 'timelyllm_ros.engines.sim', False),
                   Import('timelyllm_ros.core.request', 'timelyllm_ros.language.segmenter', True),
                   Import('timelyllm_ros.policies.semantic', 'timelyllm_ros.engines.base', True),
                   Import('lrtrace.nodes', 'lrtrace.replay', True)]) == [
        'timelyllm_ros.core.request (L0) -> timelyllm_ros.language.segmenter (L1)',
        'timelyllm_ros.core.scheduler (L3) -> timelyllm_ros.live.service (L4)',
        'timelyllm_ros.policies.semantic (L2) -> timelyllm_ros.engines.sim (L3)']


def _core_modules() -> list[str]:
    return sorted(m for m in MODULES if not any(_within(m, r) for r in ROS_MODULES)
                  and not m.endswith('__main__'))


def test_core_imports_with_ros_and_vendor_libraries_blocked():
    blocked = ', '.join(f'{name!r}: None' for name in (*ROS_LIBRARIES, *VENDOR_OWNERS))
    modules = _core_modules()
    code = (f'import sys; sys.modules.update({{{blocked}}})\n'
            f'import importlib\nfor m in {modules!r}: importlib.import_module(m)\n'
            f"print('ok', len({modules!r}))")
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('ok')


def test_no_core_source_imports_ros():
    offenders = [f'{i.importer}: {i.target}' for i in IMPORTS
                 if not any(_within(i.importer, r) for r in ROS_MODULES)
                 and any(_within(i.target, ros) for ros in (*ROS_LIBRARIES, *ROS_MODULES))]
    assert offenders == []


def test_vendor_libraries_only_lazily_in_their_wrappers():
    offenders = []
    for i in IMPORTS:
        for vendor, owners in VENDOR_OWNERS.items():
            if not _within(i.target, vendor):
                continue
            if i.module_level or not any(_within(i.importer, owner) for owner in owners):
                offenders.append(f'{i.importer}: {i.target}'
                                 + (' (module level)' if i.module_level else ''))
    assert offenders == []
