"""Engines are a plug-in family: a new engine is one module.

:class:`ToyEngine` below is a whole engine: a "model" over a fixed vocabulary that writes one
Tello plan, token by token. It subclasses :class:`~timelyllm_ros.engines.real.RealEngine` and
fills in only its tokenizer, its prompt ids, its forward pass and its memory and latency; the
kept token ids, the running set, the step that takes each token into a ``StepResult``, the
stats and ``count_tokens``/``token_ids`` are the base's. It is built by
``create_engine('module:Class')`` and planned through the scheduler like any engine.
"""

from __future__ import annotations

from collections.abc import Collection

import pytest

from timelyllm_ros.core.clock import SimClock
from timelyllm_ros.core.request import TaskSpec, TaskStatus
from timelyllm_ros.core.scheduler import Scheduler
from timelyllm_ros.core.tuf import NORMAL
from timelyllm_ros.engines import create_engine, engine_options
from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.engines.constraint import TokenGrammar
from timelyllm_ros.engines.kept import KeptTokens, PieceDetokenizer
from timelyllm_ros.engines.real import ForwardPass, RealEngine
from timelyllm_ros.errors import EngineError
from timelyllm_ros.policies import create_policy

VOCAB = ('<eos>', ' ', 'mf', 'tc', '(', ')', ';', '50', '90', '<word>')
EOS = 0
PLAN = (2, 4, 7, 5, 6, 3, 4, 8, 5)          # mf(50);tc(90)


class ToyEngine(RealEngine[KeptTokens]):
    """Writes ``mf(50);tc(90)`` for every request, one token per decode iteration."""

    backend_name = 'toy'

    def __init__(self, model: str = 'toy', max_num_seqs: int = 4,
                 lookahead_tokens: int = 0) -> None:
        super().__init__(model, max_num_seqs, lookahead_tokens)
        self.max_context = 8192
        self.eos_ids = frozenset({EOS})

    def _encode(self, text: str) -> list[int]:
        return [VOCAB.index(word) if word in VOCAB else len(VOCAB) - 1
                for word in text.split()]

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        return self._encode(request.prompt)

    def _new_generation(self, request: EngineRequest, prompt_ids: list[int],
                        forced: list[int] | None, grammar: TokenGrammar | None) -> KeptTokens:
        return KeptTokens(request, prompt_ids, forced,
                          detokenizer=PieceDetokenizer(lambda token: VOCAB[token].encode()))

    def _forward_pass(self, only: Collection[str] | None) -> ForwardPass:
        """Prefill the prompts that joined, else decode the running generations (of the
        mask ``only``); every row's next token is the plan's next one."""
        joining = [r for r in self._running if self._generations[r].pending > 1]
        rows = joining or [r for r in self._running if only is None or r in only] or list(
            self._running)
        forward = ForwardPass(prefill=bool(joining), batch_size=len(rows))
        for request_id in rows:
            generation = self._generations[request_id]
            if joining:
                forward.prefill_tokens += generation.pending
            generation.cached, generation.location = generation.total, 'device'   # its "KV"
            index = len(generation.output_ids)
            forward.produced[request_id] = PLAN[index] if index < len(PLAN) else EOS
        return forward

    def _fits(self, generation: KeptTokens) -> bool:
        return True                                   # its "KV" never runs out

    def run_cost_s(self, request_id: str) -> float:
        return 0.0

    def decode_step_s(self, batch_size: int) -> float:
        return 0.001


TOY = f'{__name__}:ToyEngine'


def _tello_task(task_id: str) -> TaskSpec:
    return TaskSpec(task_id, f'{task_id}-drone', 'tello', 'normal', 'T0', NORMAL, 0.0,
                    'find the cat', 400, task_tokens=10)


def test_a_new_engine_is_built_by_module_and_class_with_its_options_checked() -> None:
    engine = create_engine(TOY, max_num_seqs='2')
    assert isinstance(engine, ToyEngine) and engine.max_num_seqs == 2
    assert set(engine_options(TOY)) == {'model', 'max_num_seqs', 'lookahead_tokens'}
    assert engine.supports('tokenizer') and not engine.supports('grammar')
    assert engine.count_tokens('mf ( 50 )') == 4
    with pytest.raises(EngineError, match=f"engine '{TOY}' takes no option 'warp'"):
        create_engine(TOY, warp='on')


def test_the_shared_step_takes_each_token_and_ends_at_eos() -> None:
    engine = create_engine(TOY)
    engine.register(EngineRequest('a', 'fly to the kitchen', 4, max_tokens=32))
    engine.run('a')
    first = engine.step()
    assert first.prefill_tokens == 4 and first.text == {'a': 'mf'} and first.token_ids == {
        'a': (2,)}
    text = 'mf'
    while engine.running:
        result = engine.step()
        text += result.text.get('a', '')
    assert text == 'mf(50);tc(90)' and result.finished == {'a': 'eos'}
    assert engine.token_ids('a') == PLAN
    stats = engine.stats()
    assert (stats.model, stats.steps) == ('toy', engine.steps) and stats.busy_s >= 0
    engine.release('a')
    with pytest.raises(EngineError, match="unknown request 'a'"):
        engine.token_ids('a')
    engine.close()
    with pytest.raises(EngineError, match='the toy engine is closed'):
        engine.register(EngineRequest('b', 'p', 1, max_tokens=4))


def test_the_scheduler_plans_on_the_new_engine_segment_by_segment() -> None:
    engine = create_engine(TOY)
    scheduler = Scheduler(create_policy('timelyllm'), engine, SimClock())
    generation = scheduler.submit(_tello_task('t0'))
    dispatched = []
    for _ in range(100):
        dispatched.extend(scheduler.tick().dispatches)
        if generation.status >= TaskStatus.GENERATED:
            break
    assert generation.status == TaskStatus.GENERATED      # the robot has yet to report
    assert [d.segment.text for d in dispatched] == ['mf(50)', ';tc(90)']
    assert [c.skill for d in dispatched for c in d.segment.calls] == ['move_forward',
                                                                       'turn_cw']
    assert [d.segment.tokens for d in dispatched] == [4, 5]        # mf ( 50 ) | ; tc ( 90 )
    assert dispatched[-1].segment.is_last and engine.running == ()


def test_the_repetition_penalty_is_one_rule_on_the_host_and_on_a_device_row() -> None:
    """CTRL's rule (positive logits divided, negative multiplied) on the output's tokens only,
    the same on a numpy row and on a torch tensor (the row where a GPU model leaves it)."""
    import numpy as np

    from timelyllm_ros.engines.kept import choose_token, penalize

    row = np.array([2.0, -1.0, 3.0, 0.5, -4.0, 2.9], dtype=np.float32)
    host = row.copy()
    penalize(host, [2, 1, 2, 4], 1.25)
    expected = row.copy()
    expected[[1, 2, 4]] = [-1.25, 2.4, -5.0]
    assert host.tolist() == expected.tolist()
    torch = pytest.importorskip('torch', reason='torch is not installed')
    device_row = torch.tensor(row)
    penalize(device_row, [2, 1, 2, 4], 1.25)
    assert device_row.tolist() == host.tolist()
    # the penalised argmax: token 2 (3.0) falls to 2.4, below token 5 (2.9)
    request = EngineRequest('p', 'x', 1, 8, repetition_penalty=1.25)
    generation = KeptTokens(request, prompt_ids=[], output_ids=[2])
    for logits in (row.copy(), torch.tensor(row), lambda: row.copy()):
        assert choose_token(generation, 2, logits, eos=0) == 5


@pytest.mark.parametrize(('cores', 'threads'), [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_the_cpu_engine_leaves_one_usable_core_to_the_rest(monkeypatch, cores, threads) -> None:
    """llama.cpp's threads spin at barriers: on a core another process takes, a step that
    took 24 ms took 925 ms (2 cores, benchmarks/llamacpp_engine.py). The default leaves one
    of the cores this process may use (its affinity, not the machine's count) free."""
    import os

    from timelyllm_ros.engines import llamacpp

    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, 'cpu_count', lambda: 64)
    assert llamacpp.usable_cores() == cores
    assert llamacpp.default_threads() == threads
