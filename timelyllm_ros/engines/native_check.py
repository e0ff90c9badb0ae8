"""An engine's native library checked in a child process before the fleet relies on it.

Real engines run native code (llama.cpp, torch, vLLM) built for the machine's CPU or GPU. A
fault there (a SIGSEGV or SIGILL in a vendor kernel) kills the whole process: a planner, a
benchmark or a test run dies with no word on why. :func:`check_engine` builds the engine in a
child process, prefills a prompt and decodes a few tokens (the path of every plan), and turns
any death of the child into a verdict naming the signal and the last lines the child wrote.

    timelyllm check-engine --engine cpu --model smollm2
    python3 -m timelyllm_ros.engines.native_check --engine cpu --model smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from timelyllm_ros.errors import TimelyError, describe_error

PROMPT = 'Task: fly forward one metre, then turn right and land.\nPlan:'
DECODE_TOKENS = 8     # prefill plus batched decodes of 2+ tokens: where AMX crashed llama.cpp


@dataclass(frozen=True, slots=True)
class NativeCheck:
    """What became of one engine in its child process."""

    engine: str
    ok: bool
    reason: str          # '' when ok; else the signal, exit code or error, in words
    output: str = ''     # the child's last lines (stderr and stdout)
    tokens: int = 0      # tokens the child decoded

    def describe(self) -> str:
        if self.ok:
            return f'engine {self.engine!r}: ok ({self.tokens} tokens decoded in a child process)'
        text = f'engine {self.engine!r} cannot run on this machine: {self.reason}'
        return f'{text}\n--- last output of the child process ---\n{self.output}' if (
            self.output) else text


def check_engine(engine: str = 'cpu', model: str | None = None,
                 options: dict[str, object] | None = None, timeout_s: float = 300.0,
                 env: dict[str, str] | None = None) -> NativeCheck:
    """Build ``engine`` in a child process and decode a few tokens; never raises for what
    happens in the child (a crash, a hang past ``timeout_s``, an error)."""
    argv = [sys.executable, '-m', __name__, '--engine', engine,
            '--options', json.dumps(options or {})]
    if model:
        argv += ['--model', model]
    return run_check(engine, argv, timeout_s, env)


def run_check(engine: str, argv: list[str], timeout_s: float,
              env: dict[str, str] | None = None) -> NativeCheck:
    """Run one child and read its verdict: the JSON line it printed last, or how it died."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors='replace',
                              timeout=timeout_s, env={**os.environ, **(env or {})},
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as err:
        tail = _tail(_text(err.stderr) + _text(err.stdout))
        return NativeCheck(engine, False, f'no answer within {timeout_s:.0f} s (hung)', tail)
    except OSError as err:
        return NativeCheck(engine, False, f'could not start the child: {err}')
    tail = _tail(done.stderr + done.stdout)
    if done.returncode < 0:
        killer = _signal_name(-done.returncode)
        return NativeCheck(engine, False,
                           f'the child was killed by {killer} (a fault in the native library)',
                           tail)
    verdict = _last_json(done.stdout)
    if done.returncode != 0 or verdict is None:
        reason = (str(verdict['error']) if verdict and verdict.get('error')
                  else f'the child exited with code {done.returncode}')
        return NativeCheck(engine, False, reason, tail)
    return NativeCheck(engine, True, '', '', int(verdict.get('tokens', 0)))


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode('utf-8', 'replace')
    return data or ''


def _tail(text: str, lines: int = 20) -> str:
    return '\n'.join(text.strip().splitlines()[-lines:])


def _signal_name(number: int) -> str:
    try:
        return f'{signal.Signals(number).name} (signal {number})'
    except ValueError:
        return f'signal {number}'


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def decode_a_few_tokens(engine_name: str, model: str | None, options: dict[str, object]) -> int:
    """In this process: build the engine, prefill :data:`PROMPT`, decode
    :data:`DECODE_TOKENS` tokens in a batch of two, close it; returns the tokens decoded."""
    from timelyllm_ros.engines import EngineRequest, create_engine

    engine = create_engine(engine_name, model, **options)
    try:
        ids = ('native-check-0', 'native-check-1')
        for request_id in ids:
            engine.register(EngineRequest(request_id=request_id, prompt=PROMPT,
                                          prompt_tokens=len(PROMPT.split()),
                                          max_tokens=DECODE_TOKENS,
                                          script=('mf(50)', ';', 'tc(90)')))  # the simulator's
            engine.run(request_id)
        tokens = 0
        for _ in range(4 * DECODE_TOKENS):
            result = engine.step()
            tokens += sum(len(ids) for ids in result.token_ids.values())
            if not engine.running:
                break
        for request_id in ids:
            engine.release(request_id)
        return tokens
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--engine', default='cpu')
    parser.add_argument('--model', default=None)
    parser.add_argument('--options', default='{}', help='engine options as a JSON object')
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.options)
        if not isinstance(options, dict):
            raise ValueError('--options must be a JSON object')
        tokens = decode_a_few_tokens(args.engine, args.model, options)
    except (TimelyError, ValueError) as err:
        print(json.dumps({'ok': False, 'error': describe_error(err)}), flush=True)
        return 1
    print(json.dumps({'ok': True, 'tokens': tokens}), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
