"""Segmenter: cut points, statement validation and rejections for skills and chatbot text."""

from __future__ import annotations

from itertools import pairwise

import pytest

from timelyllm_ros.errors import SegmentationError
from timelyllm_ros.language.profiles import RobotProfile
from timelyllm_ros.language.segmenter import (
    Cut,
    Segmenter,
    Statement,
    segment_pieces,
    segment_text,
)

_CONST = {'kind': 'constant', 'seconds': 1.0}


def _skill(name: str, short: str, *args: tuple, query: bool = False) -> dict:
    out = []
    for arg in args:
        spec = {'name': arg[0], 'type': arg[1]}
        if len(arg) > 2:
            spec.update(min=arg[2], max=arg[3])
        out.append(spec)
    return {'name': name, 'short': short, 'args': out, 'exec_time': _CONST, 'query': query}


def _profile(name: str, kind: str, skills: list[dict], **extra: object) -> RobotProfile:
    data = {
        'name': name,
        'kind': kind,
        'segment_generation_s': 0.2,
        'max_segment_tokens': 16,
        'max_tokens': 256,
        'exec_time_provenance': 'test figures, not measured',
        'skills': skills,
        'prompt': {'system': 'plan'},
        **extra,
    }
    return RobotProfile.model_validate(data)


def drone_profile() -> RobotProfile:
    """Build a small Tello-like drone: mf, tc, s, g, iv, l, tp, d."""
    return _profile('drone', 'drone', [
        _skill('move_forward', 'mf', ('distance', 'int', 20, 500)),
        _skill('turn_cw', 'tc', ('degrees', 'int', 1, 360)),
        _skill('scan', 's', ('object', 'str'), query=True),
        _skill('goto', 'g', ('object', 'str')),
        _skill('is_visible', 'iv', ('object', 'str'), query=True),
        _skill('log', 'l', ('text', 'str')),
        _skill('take_picture', 'tp'),
        _skill('delay', 'd', ('seconds', 'float', 0, 60)),
    ])


def arm_profile() -> RobotProfile:
    """Build a small pick-and-place arm."""
    return _profile('arm', 'arm', [
        _skill('move_to', 'move_to', ('object', 'str')),
        _skill('pick', 'pick', ('object', 'str')),
        _skill('place', 'place', ('object', 'str'), ('where', 'str')),
    ])


def chat_profile(segmentation: str = 'sentence') -> RobotProfile:
    """Build a chatbot profile cut by sentence or paragraph."""
    return _profile('chat', 'chatbot', [], segmentation=segmentation, words_per_minute=300)


def feed_all(profile: RobotProfile, pieces, reason='eos') -> tuple[list[Cut], Segmenter]:
    seg = Segmenter(profile)
    cuts = [c for c in (seg.feed(p) for p in pieces) if c is not None]
    cuts.append(seg.finish(reason))
    return cuts, seg


def texts(cut: Cut) -> list[str]:
    return [s.text for s in cut.statements]


# --- simple statements --------------------------------------------------------------------------


def test_char_by_char_cuts_at_each_closing_paren():
    text = 'mf(50);tc(90);'
    seg = Segmenter(drone_profile())
    got = [(i, seg.feed(ch)) for i, ch in enumerate(text)]
    cuts = [(i, c) for i, c in got if c is not None]
    assert [i for i, _ in cuts] == [5, 12]
    first, second = cuts[0][1], cuts[1][1]
    assert (first.text, first.start, first.end, first.reason) == ('mf(50)', 0, 6, 'skill')
    assert texts(first) == ['mf(50)']
    assert first.calls[0].skill == 'move_forward'
    assert first.calls[0].short == 'mf'
    assert first.calls[0].args == {'distance': 50}
    assert first.calls[0].text == 'mf(50)'
    assert (second.text, second.start, second.end) == (';tc(90)', 6, 13)
    assert second.calls[0].args == {'degrees': 90}
    final = seg.finish()
    assert (final.text, final.start, final.end, final.final) == (';', 13, 14, True)
    assert final.statements == () and final.rejected == ()
    assert seg.text == text


def test_one_delta_with_two_statements_gives_one_cut():
    seg = Segmenter(drone_profile())
    cut = seg.feed('mf(50);tc(90);')
    assert cut is not None
    assert texts(cut) == ['mf(50)', 'tc(90)']
    assert (cut.text, cut.start, cut.end) == ('mf(50);tc(90)', 0, 13)
    assert [c.args for c in cut.calls] == [{'distance': 50}, {'degrees': 90}]
    assert seg.finish().text == ';'


def test_partial_tokens_cut_only_at_closing_paren():
    seg = Segmenter(drone_profile())
    assert seg.feed('m') is None
    assert seg.feed('f(') is None
    assert seg.feed('5') is None
    cut = seg.feed('0)')
    assert cut is not None and cut.text == 'mf(50)' and cut.calls[0].args == {'distance': 50}


def test_cut_does_not_wait_for_separator_and_keeps_rest_buffered():
    seg = Segmenter(drone_profile())
    cut = seg.feed('mf(50);  tc(')
    assert cut is not None and (cut.text, cut.end) == ('mf(50)', 6)
    cut = seg.feed('90)\n')
    assert cut is not None and (cut.text, cut.start, cut.end) == (';  tc(90)', 6, 15)


def test_whitespace_and_newlines_are_insignificant():
    text = '  mf ( 50 ) ;\n\n tc(\n 90\n)\nd( 1.5 )\ntp( )'
    cuts, seg = feed_all(drone_profile(), list(text))
    statements = [s for c in cuts for s in c.statements]
    assert [s.text for s in statements] == ['mf ( 50 )', 'tc(\n 90\n)', 'd( 1.5 )', 'tp( )']
    assert [s.calls[0].args for s in statements] == [
        {'distance': 50}, {'degrees': 90}, {'seconds': 1.5}, {}]
    assert seg.rejected == []
    assert ''.join(c.text for c in cuts) == text


def test_quoted_and_unquoted_string_arguments():
    cut = segment_text(drone_profile(), "s('red box');g(\"door\");l(hello world)")[0]
    assert [c.args for c in cut.calls] == [
        {'object': 'red box'}, {'object': 'door'}, {'text': 'hello world'}]


def test_parens_inside_quotes_are_ignored():
    seg = Segmenter(drone_profile())
    assert seg.feed("l('found (cat") is None
    assert seg.feed(')') is None
    cut = seg.feed("')")
    assert cut is not None
    assert texts(cut) == ["l('found (cat)')"]
    assert cut.calls[0].args == {'text': 'found (cat)'}


def test_nested_call_as_argument_is_malformed_and_complete_at_outer_paren():
    seg = Segmenter(drone_profile())
    assert seg.feed("l(iv('cat')") is None
    assert seg.rejected == []
    assert seg.feed(')') is None
    assert len(seg.rejected) == 1
    bad = seg.rejected[0]
    assert bad.text == "l(iv('cat'))"
    assert bad.error == "l: argument 1 must be a literal, not \"iv('cat')\""
    assert not bad.executable
    cut = seg.feed(';mf(20)')
    assert cut is not None and texts(cut) == ['mf(20)']
    assert cut.rejected == (bad,)
    assert cut.text == "l(iv('cat'));mf(20)"


@pytest.mark.parametrize(('text', 'error'), [
    ('fly(50)', "unknown skill 'fly'"),
    ('mf(abc)', "mf: distance: 'abc' is not int"),
    ('mf(10)', 'mf: distance=10 below the minimum 20 '),
    ('mf(501)', 'mf: distance=501 above the maximum 500 '),
    ('tc(0)', 'tc: degrees=0 below the minimum 1 '),
    ('mf()', 'mf takes 1 argument(s) (distance), got 0'),
    ('mf(50, 60)', 'mf takes 1 argument(s) (distance), got 2'),
    ('tp(1)', 'tp takes 0 argument(s) (none), got 1'),
    ('s(5)', "s: object: '5' is not a string"),
    ('d(61.0)', 'd: seconds=61.0 above the maximum 60 '),
    ('mf(5 0)', "mf: distance: '5 0' is not int"),
])
def test_invalid_simple_statement_is_rejected(text, error):
    cuts, seg = feed_all(drone_profile(), [text, ';mf(30);'])
    assert len(cuts) == 2
    assert texts(cuts[0]) == ['mf(30)']
    assert [s.error for s in cuts[0].rejected] == [error]
    assert cuts[0].rejected[0].text == text
    assert [(s.text, s.error) for s in seg.rejected] == [(text, error)]
    assert all(s.error is None for c in cuts for s in c.statements)


def test_skill_by_full_name_uses_canonical_name():
    cut = segment_text(drone_profile(), 'move_forward(100)')[0]
    assert (cut.calls[0].skill, cut.calls[0].short, cut.calls[0].args) == (
        'move_forward', 'move_forward', {'distance': 100})


# --- conditionals and loops ---------------------------------------------------------------------


def test_conditional_cut_only_at_matching_brace():
    text = "?iv('cat')==True{g('cat');tp()};mf(20)"
    seg = Segmenter(drone_profile())
    cuts = [(i, seg.feed(ch)) for i, ch in enumerate(text)]
    cuts = [(i, c) for i, c in cuts if c is not None]
    assert [i for i, _ in cuts] == [30, 37]
    cond = cuts[0][1].statements[0]
    assert cond.text == "?iv('cat')==True{g('cat');tp()}"
    assert cond.kind == 'conditional' and cond.repeat == 1 and cond.error is None
    assert [c.skill for c in cond.calls] == ['is_visible', 'goto', 'take_picture']
    assert cond.calls[0].args == {'object': 'cat'}


@pytest.mark.parametrize('cond', [
    "?iv('cat'){g('cat')}",
    "? iv('cat') != False { g('cat') ; }",
    "?iv('cat')=='yes'{g('cat')}",
    "?iv('cat')>=3{g('cat')}",
    "?iv('cat'){\n  g('cat');\n  tp()\n}",
])
def test_conditional_forms_are_valid(cond):
    cuts, seg = feed_all(drone_profile(), list(cond))
    assert seg.rejected == []
    assert [s.kind for s in cuts[0].statements] == ['conditional']
    assert cuts[0].statements[0].text == cond.strip()
    assert cuts[0].end == len(cond.rstrip())


def test_nested_loop_and_conditional():
    text = "3{tc(90);?iv('cat'){2{tp()};l('seen')}};mf(50)"
    seg = Segmenter(drone_profile())
    outer = text.index('}};') + 2
    for i, ch in enumerate(text[:outer - 1]):
        assert seg.feed(ch) is None, i
    cut = seg.feed('}')
    assert cut is not None
    loop = cut.statements[0]
    assert (loop.kind, loop.repeat, loop.text) == ('loop', 3, text[:outer])
    assert [c.short for c in loop.calls] == ['tc', 'iv', 'tp', 'l']
    assert loop.calls[3].args == {'text': 'seen'}
    cut = seg.feed(';mf(50)')
    assert cut is not None and texts(cut) == ['mf(50)']


def _shape(statement: Statement) -> tuple:
    """A statement tree as nested tuples: (kind, text, repeat, condition text, op, value, body)."""
    condition = statement.condition.text if statement.condition is not None else None
    return (statement.kind, statement.text, statement.repeat, condition, statement.condition_op,
            statement.condition_value, tuple(_shape(child) for child in statement.body))


def _only_statement(text: str) -> Statement:
    cuts, seg = feed_all(drone_profile(), [text])
    assert seg.rejected == []
    (statement,) = [s for cut in cuts for s in cut.statements]
    return statement


def test_nested_loop_and_conditional_tree():
    text = "3{tc(90);?iv('cat'){2{tp()};l('seen')}}"
    loop = _only_statement(text)
    assert _shape(loop) == ('loop', text, 3, None, None, None, (
        ('skill', 'tc(90)', 1, None, None, None, ()),
        ('conditional', "?iv('cat'){2{tp()};l('seen')}", 1, "iv('cat')", None, None, (
            ('loop', '2{tp()}', 2, None, None, None, (
                ('skill', 'tp()', 1, None, None, None, ()),
            )),
            ('skill', "l('seen')", 1, None, None, None, ()),
        )),
    ))
    conditional = loop.body[1]
    assert conditional.condition is conditional.calls[0]
    assert conditional.condition.args == {'object': 'cat'}
    assert [c.short for c in conditional.calls] == ['iv', 'tp', 'l']
    assert [c.short for c in conditional.body[0].calls] == ['tp']


def test_nested_conditionals_keep_their_own_comparison():
    text = "?iv('cat')==True{?iv('dog')!=False{g('dog');tp()};mf(50)}"
    outer = _only_statement(text)
    assert _shape(outer) == ('conditional', text, 1, "iv('cat')", '==', True, (
        ('conditional', "?iv('dog')!=False{g('dog');tp()}", 1, "iv('dog')", '!=', False, (
            ('skill', "g('dog')", 1, None, None, None, ()),
            ('skill', 'tp()', 1, None, None, None, ()),
        )),
        ('skill', 'mf(50)', 1, None, None, None, ()),
    ))
    assert [c.text for c in outer.calls] == ["iv('cat')", "iv('dog')", "g('dog')", 'tp()',
                                             'mf(50)']


def test_multiline_body_tree_texts_are_stripped():
    text = "4{\n  tc(90)\n  ?iv('keys') == 3 {\n    l('x')\n  }\n}"
    loop = _only_statement(text)
    assert loop.text == text and loop.repeat == 4
    turn, check = loop.body
    assert (turn.kind, turn.text) == ('skill', 'tc(90)')
    assert check.text == "?iv('keys') == 3 {\n    l('x')\n  }"
    assert (check.condition_op, check.condition_value) == ('==', 3)
    assert [child.text for child in check.body] == ["l('x')"]


def test_flat_statements_have_no_tree():
    statement = _only_statement('mf(50)')
    assert statement.kind == 'skill' and statement.body == () and statement.condition is None
    hand_built = Statement('mf(50)', statement.calls)
    assert hand_built.body == () and hand_built.condition is None and hand_built.executable


@pytest.mark.parametrize(('text', 'error'), [
    ("?fly('cat'){g('cat')}", "unknown skill 'fly'"),
    ("?iv(){g('cat')}", 'iv takes 1 argument(s) (object), got 0'),
    ("?iv('cat')=={g('cat')}", "expected a literal after '==' in the condition"),
    ("?iv('cat')==maybe{g('cat')}", "expected a literal after '==' in the condition"),
    ("?iv('cat'){}", 'empty body'),
    ("?{g('cat')}", "a condition '?' must be followed by a skill call"),
    ("?iv('cat'){g('cat');mf(5)}", 'mf: distance=5 below the minimum 20 '),
    ("?iv('cat'){g('cat') tp()}", "expected ';' or '}' in the body, found 't'"),
    ('0{tp()}', 'a loop count must be a positive integer, got 0'),
    ('2.5{tp()}', 'a loop count must be a positive integer'),
    ('2{}', 'empty body'),
])
def test_malformed_compound_is_rejected_whole(text, error):
    cuts, seg = feed_all(drone_profile(), list(text + ';tp()'))
    assert [s.error for s in seg.rejected] == [error]
    assert seg.rejected[0].text == text
    dispatched = [s.text for c in cuts for s in c.statements]
    assert dispatched == ['tp()']
    assert cuts[0].rejected == tuple(seg.rejected)


def test_condition_without_body_is_rejected_at_separator():
    cuts, seg = feed_all(drone_profile(), ["?iv('cat')\n", 'tp()'])
    assert [(s.text, s.error) for s in seg.rejected] == [
        ("?iv('cat')", "expected '{' after the condition, found the end")]
    assert texts(cuts[0]) == ['tp()']


# --- junk, stray closers, end of generation -----------------------------------------------------


def test_leading_chatter_and_code_fences_are_rejected_not_dispatched():
    text = "Plan:\n```\nmf(50);\nHere's it\ntc(90)\n```"
    cuts, seg = feed_all(drone_profile(), list(text))
    assert [s.text for c in cuts for s in c.statements] == ['mf(50)', 'tc(90)']
    assert [s.text for s in seg.rejected] == ['Plan:', '```', "Here's it", '```']
    assert seg.rejected[0].error == "expected '(' after 'Plan', found ':'"
    assert seg.rejected[2].error == 'unterminated quote at the end of the line'
    assert cuts[0].rejected == tuple(seg.rejected[:2])
    assert cuts[1].rejected == (seg.rejected[2],)
    assert cuts[2].rejected == (seg.rejected[3],)
    assert seg.rejected[3].error.startswith('incomplete statement at end of generation (eos)')


def test_stray_closer_rejects_and_resynchronises():
    cuts, seg = feed_all(drone_profile(), list('mf(50));tp) mf(60);tc(90)'))
    assert [s.text for c in cuts for s in c.statements] == ['mf(50)', 'tc(90)']
    assert [(s.text, s.error) for s in seg.rejected] == [
        (')', "unbalanced ')'"), ('tp) mf(60)', "unbalanced ')'")]
    assert cuts[1].rejected == tuple(seg.rejected)


def test_stray_brace_and_mismatched_bracket():
    cuts, seg = feed_all(drone_profile(), ['}\nmf(5}0);\nmf(40)'])
    assert [(s.text, s.error) for s in seg.rejected] == [
        ('}', "unbalanced '}'"), ('mf(5}0)', "mismatched '}' (expected ')')")]
    assert texts(cuts[0]) == ['mf(40)']


@pytest.mark.parametrize('reason', ['eos', 'length'])
@pytest.mark.parametrize(('tail', 'detail'), [
    ('mf(5', ": missing ')'"),
    ("l('unterminated (", ": unterminated quote '"),
    ("?iv('cat'){g('cat');", ": missing '}'"),
    ('tc', ''),
])
def test_incomplete_trailing_statement_at_finish(reason, tail, detail):
    seg = Segmenter(drone_profile())
    cut = seg.feed('mf(50);' + tail)
    assert cut is not None and cut.text == 'mf(50)'
    final = seg.finish(reason)
    assert (final.final, final.reason, final.statements) == (True, reason, ())
    assert (final.text, final.start, final.end) == (';' + tail, 6, 7 + len(tail))
    assert [(s.text, s.error) for s in final.rejected] == [
        (tail, f'incomplete statement at end of generation ({reason}){detail}')]
    assert seg.rejected == list(final.rejected)


def test_whitespace_only_rest_gives_empty_final_cut():
    seg = Segmenter(drone_profile())
    seg.feed('tp()')
    final = seg.finish('length')
    assert (final.text, final.statements, final.rejected, final.start, final.end) == (
        '', (), (), 4, 4)
    seg = Segmenter(drone_profile())
    seg.feed('tp() ;\n  ')
    final = seg.finish()
    assert (final.text, final.statements, final.rejected, final.reason) == (
        ' ;\n  ', (), (), 'eos')


def test_feed_or_finish_after_finish_raises():
    seg = Segmenter(drone_profile())
    seg.feed('tp()')
    seg.finish()
    with pytest.raises(SegmentationError):
        seg.feed('mf(50)')
    with pytest.raises(SegmentationError):
        seg.finish()


def test_empty_feed_returns_none():
    seg = Segmenter(drone_profile())
    assert seg.feed('') is None
    assert seg.finish().text == ''


# --- chatbot text -------------------------------------------------------------------------------


def test_sentences_cut_after_terminator_once_whitespace_arrives():
    seg = Segmenter(chat_profile())
    assert seg.feed('Hi!') is None
    cut = seg.feed(' How')
    assert cut is not None
    assert (cut.text, cut.start, cut.end, cut.reason) == ('Hi!', 0, 3, 'sentence')
    assert [(s.text, s.kind, s.executable) for s in cut.statements] == [('Hi!', 'text', True)]
    assert seg.feed(' are you?') is None
    final = seg.finish()
    assert (final.text, texts(final), final.final) == (' How are you?', ['How are you?'], True)


def test_two_sentences_in_one_delta_and_decimal_numbers():
    cuts = segment_text(chat_profile(), 'Pi is 3.14 roughly. Yes! e.g.x is fine?" Ok')
    assert [texts(c) for c in cuts] == [
        ['Pi is 3.14 roughly.', 'Yes!', 'e.g.x is fine?"'], ['Ok']]
    assert cuts[0].text == 'Pi is 3.14 roughly. Yes! e.g.x is fine?"'
    assert cuts[1].text == ' Ok'


def test_sentence_closing_bracket_and_char_by_char():
    text = 'He said "stop." (Really!) Then 3.14.\nEnd'
    cuts, _ = feed_all(chat_profile(), list(text))
    assert [texts(c) for c in cuts] == [
        ['He said "stop."'], ['(Really!)'], ['Then 3.14.'], ['End']]
    assert [c.end for c in cuts] == [15, 25, 36, 40]


def test_paragraph_cut_at_blank_line():
    text = 'First para.\nStill first.\n  \nSecond.\n\n\n'
    seg = Segmenter(chat_profile('paragraph'))
    got = [(i, seg.feed(ch)) for i, ch in enumerate(text)]
    cuts = [(i, c) for i, c in got if c is not None]
    assert [i for i, _ in cuts] == [27, 36]
    first = cuts[0][1]
    assert (first.text, first.reason, texts(first)) == (
        'First para.\nStill first.', 'paragraph', ['First para.\nStill first.'])
    assert (cuts[1][1].text, texts(cuts[1][1])) == ('\n  \nSecond.', ['Second.'])
    final = seg.finish()
    assert (final.text, final.statements) == ('\n\n\n', ())


def test_paragraph_final_rest_is_a_statement():
    cuts = segment_text(chat_profile('paragraph'), 'One.\n\nTwo. Three.')
    assert [texts(c) for c in cuts] == [['One.'], ['Two. Three.']]
    assert [c.final for c in cuts] == [False, True]


# --- offline helpers and a longer plan ----------------------------------------------------------


def test_segment_pieces_indices():
    pieces = ['m', 'f(', '50', ');', 't', 'c(9', '0);', 's(', "'x", "')", '\n', 'tc(']
    out = segment_pieces(drone_profile(), pieces, reason='length')
    assert [i for i, _ in out] == [3, 6, 9, 11]
    assert [c.text for _, c in out] == ['mf(50)', ';tc(90)', ";s('x')", '\ntc(']
    assert out[-1][1].final and out[-1][1].reason == 'length'
    assert out[-1][1].rejected[0].error == (
        "incomplete statement at end of generation (length): missing ')'")


def test_segment_pieces_empty():
    out = segment_pieces(drone_profile(), [])
    assert len(out) == 1 and out[0][0] == -1 and out[0][1].text == ''


ARM_PLAN = [
    "move_to('red_box')", "pick('red_box')", "move_to('table')", "place('red_box', 'table')",
    "move_to('blue_box')", "pick('blue_box')", "move_to('shelf')",
    "place('blue_box', \"top shelf\")",
]


def test_arm_plan_token_by_token_gives_one_cut_per_statement():
    text = ';\n'.join(ARM_PLAN) + ';'
    # crude tokenizer: identifiers, quoted-string fragments of 3 chars, single punctuation
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    cuts, seg = feed_all(arm_profile(), pieces)
    assert len(cuts) == 9 and cuts[-1].statements == ()
    assert [texts(c) for c in cuts[:-1]] == [[s] for s in ARM_PLAN]
    assert cuts[3].calls[0].args == {'object': 'red_box', 'where': 'table'}
    assert cuts[7].calls[0].args == {'object': 'blue_box', 'where': 'top shelf'}
    assert seg.rejected == []
    assert ''.join(c.text for c in cuts) == text
    for a, b in pairwise(cuts):
        assert a.end == b.start


def test_segment_text_whole_plan_one_cut():
    text = ';'.join(ARM_PLAN)
    cuts = segment_text(arm_profile(), text)
    assert len(cuts) == 2
    assert texts(cuts[0]) == ARM_PLAN
    assert (cuts[1].text, cuts[1].final) == ('', True)
