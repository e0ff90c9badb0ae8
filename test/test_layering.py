"""The core never imports ROS 2, vendor robot clients or GPU engines (STYLE.md layering)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import lrtrace
import timelyllm_ros

FORBIDDEN = ('rclpy', 'launch', 'launch_ros', 'rosidl_runtime_py', 'torch', 'vllm',
             'djitellopy', 'neuromeka', 'timelyllm_ros.nodes', 'timelyllm_ros.msg',
             'timelyllm_ros.action')


def core_modules() -> list[str]:
    names = []
    for package in (timelyllm_ros, lrtrace):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):
            if '.nodes' not in info.name and not info.name.endswith('__main__'):
                names.append(info.name)
    return names


def test_core_imports_with_ros_and_gpu_libraries_blocked():
    blocked = ', '.join(f'{name!r}: None' for name in FORBIDDEN)
    modules = core_modules()
    code = (f'import sys; sys.modules.update({{{blocked}}})\n'
            f'import importlib\nfor m in {modules!r}: importlib.import_module(m)\n'
            f"print('ok', len({modules!r}))")
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('ok')


def test_no_core_source_imports_a_forbidden_module():
    offenders = []
    for package in (timelyllm_ros, lrtrace):
        root = Path(package.__path__[0])
        for path in root.rglob('*.py'):
            if 'nodes' in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ''] if isinstance(node, ast.ImportFrom) else [])
                for name in names:
                    if any(name == f or name.startswith(f + '.') for f in FORBIDDEN):
                        offenders.append(f'{path.name}: {name}')
    assert offenders == []
