"""The core never imports ROS 2; vendor clients are imported lazily, only by their wrapper.

STYLE.md: L0–L4 never import rclpy, launch or the generated interfaces; vendor libraries
(djitellopy, neuromeka, grpc, torch, vllm) are imported only inside the module that wraps them,
and only when it is used (inside a function), so ``import timelyllm_ros.<anything>`` stays light.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import lrtrace
import timelyllm_ros

ROS = ('rclpy', 'launch', 'launch_ros', 'rosidl_runtime_py', 'timelyllm_ros.nodes',
       'timelyllm_ros.msg', 'timelyllm_ros.action')
VENDOR_OWNERS = {
    'djitellopy': ('robots/tello.py', 'robots/emulators/tello.py'),
    'neuromeka': ('robots/indy7.py', 'robots/emulators/indy7.py'),
    'grpc': ('robots/indy7.py', 'robots/emulators/indy7.py'),
    'torch': ('engines/',),
    'vllm': ('engines/vllm_engine.py',),
    'llama_cpp': ('engines/llamacpp.py',),
}


def _matches(name: str, module: str) -> bool:
    return name == module or name.startswith(module + '.')


def core_modules() -> list[str]:
    names = []
    for package in (timelyllm_ros, lrtrace):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):
            if '.nodes' not in info.name and not info.name.endswith('__main__'):
                names.append(info.name)
    return names


def core_imports():
    """(relative path, imported module, is module-level) for every import of the core."""
    for package in (timelyllm_ros, lrtrace):
        root = Path(package.__path__[0])
        for path in root.rglob('*.py'):
            relative = path.relative_to(root).as_posix()
            if relative.startswith('nodes/'):
                continue
            tree = ast.parse(path.read_text(encoding='utf-8'))
            top_level = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or '']
                else:
                    continue
                for name in names:
                    yield relative, name, id(node) in top_level


def test_core_imports_with_ros_and_vendor_libraries_blocked():
    blocked = ', '.join(f'{name!r}: None' for name in (*ROS, *VENDOR_OWNERS))
    modules = core_modules()
    code = (f'import sys; sys.modules.update({{{blocked}}})\n'
            f'import importlib\nfor m in {modules!r}: importlib.import_module(m)\n'
            f"print('ok', len({modules!r}))")
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('ok')


def test_no_core_source_imports_ros():
    offenders = [f'{path}: {name}' for path, name, _ in core_imports()
                 if any(_matches(name, ros) for ros in ROS)]
    assert offenders == []


def test_vendor_libraries_only_lazily_in_their_wrappers():
    offenders = []
    for path, name, module_level in core_imports():
        for vendor, owners in VENDOR_OWNERS.items():
            if not _matches(name, vendor):
                continue
            if module_level or not any(path.startswith(owner) for owner in owners):
                offenders.append(f'{path}: {name}' + (' (module level)' if module_level else ''))
    assert offenders == []
