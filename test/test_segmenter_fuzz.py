"""Property tests of the segmenter: robustness, contiguity, split independence, valid plans."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timelyllm_ros.language.profiles import RobotProfile
from timelyllm_ros.language.segmenter import Cut, Segmenter, Statement

_CONST = {'kind': 'constant', 'seconds': 1.0}
_SETTINGS = settings(max_examples=150, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


def _profile(segmentation: str = 'skills') -> RobotProfile:
    def skill(name: str, short: str, *args: dict) -> dict:
        return {'name': name, 'short': short, 'args': list(args), 'exec_time': _CONST,
                'query': name in ('scan', 'is_visible')}

    def num(name: str, kind: str, low: float, high: float) -> dict:
        return {'name': name, 'type': kind, 'min': low, 'max': high}

    def text(name: str) -> dict:
        return {'name': name, 'type': 'str'}

    skills = [
        skill('move_forward', 'mf', num('distance', 'int', 20, 500)),
        skill('turn_cw', 'tc', num('degrees', 'int', 1, 360)),
        skill('scan', 's', text('object')),
        skill('goto', 'g', text('object')),
        skill('is_visible', 'iv', text('object')),
        skill('log', 'l', text('text')),
        skill('take_picture', 'tp'),
        skill('delay', 'd', num('seconds', 'float', 0, 60)),
    ]
    data = {
        'name': 'drone', 'kind': 'drone' if segmentation == 'skills' else 'chatbot',
        'segmentation': segmentation, 'segment_generation_s': 0.2, 'max_segment_tokens': 16,
        'max_tokens': 256, 'exec_time_provenance': 'test figures', 'prompt': {'system': 'p'},
        'max_loop_count': 100,
        'skills': skills if segmentation == 'skills' else [],
        'words_per_minute': None if segmentation == 'skills' else 300,
    }
    return RobotProfile.model_validate(data)


DRONE = _profile()
CHAT = _profile('sentence')
PARAGRAPH = _profile('paragraph')

_ALPHABET = '()[]{};\'"?=!<>,.\n \tmftcsgivldpxa0123456789'
_SKILLS_TEXT = st.text(alphabet=_ALPHABET, max_size=80) | st.lists(
    st.sampled_from(['mf(', '50', ')', ';', 'tc(90)', "s('", 'cat', "')", '?iv(', '{', '}',
                     '3{', 'tp()', '\n', ' ', 'd(1.5)', '(', "'", '"', 'l(iv(x))', '==True',
                     "?iv('cat'){", 'g(x);', '2{tp()}', 'mf(10)']),
    max_size=25).map(''.join)
_CHAT_TEXT = st.text(alphabet='ab .!?\'")]\n\t3', max_size=80)


def _split(data: st.DataObject, text: str) -> list[str]:
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in pairwise(bounds) if b > a]


def _run(profile: RobotProfile, pieces: list[str]) -> tuple[list[Cut], Segmenter]:
    seg = Segmenter(profile)
    cuts = [c for c in (seg.feed(p) for p in pieces) if c is not None]
    cuts.append(seg.finish())
    return cuts, seg


def _check_call_valid(profile: RobotProfile, call) -> None:
    skill = profile.skill_index[call.short]
    assert skill.name == call.skill
    assert list(call.args) == [a.name for a in skill.args]
    for arg in skill.args:
        value = call.args[arg.name]
        if arg.type == 'str':
            assert isinstance(value, str)
        else:
            assert isinstance(value, int if arg.type == 'int' else float)
            assert arg.min is None or value >= arg.min
            assert arg.max is None or value <= arg.max


def _check_tree(statement: Statement) -> None:
    """The tree of a parsed statement agrees with its flat calls and its text, at every level."""
    assert statement.error is None and statement.text == statement.text.strip()
    if statement.kind == 'text':
        assert statement.calls == () and statement.body == ()
        return
    nested = tuple(call for child in statement.body for call in child.calls)
    if statement.kind == 'skill':
        assert len(statement.calls) == 1 and statement.body == () and statement.condition is None
        assert statement.text == statement.calls[0].text
    elif statement.kind == 'loop':
        assert statement.body and statement.calls == nested and statement.repeat >= 1
        assert statement.condition is None and statement.condition_op is None
    else:
        assert statement.body and statement.repeat == 1
        assert statement.condition is not None
        assert statement.calls == (statement.condition, *nested)
    position = 0
    for child in statement.body:
        position = statement.text.index(child.text, position) + len(child.text)
        _check_tree(child)


def _shape(statement: Statement) -> tuple:
    """A statement tree as nested (text, kind, repeat, children) tuples."""
    return (statement.text, statement.kind, statement.repeat,
            tuple(_shape(child) for child in statement.body))


def _check_structure(profile: RobotProfile, text: str, cuts: list[Cut], seg: Segmenter) -> None:
    assert cuts[-1].final and not any(c.final for c in cuts[:-1])
    assert ''.join(c.text for c in cuts) == text == seg.text
    assert cuts[0].start == 0 and cuts[-1].end == len(text)
    for a, b in pairwise(cuts):
        assert a.end == b.start and a.start < a.end
    for cut in cuts:
        assert cut.text == text[cut.start:cut.end]
        assert cut.statements or cut.final
        for statement in cut.statements:
            assert statement.error is None and statement.executable
            for call in statement.calls:
                _check_call_valid(profile, call)
            _check_tree(statement)
        for bad in cut.rejected:
            assert bad.error and not bad.executable
    assert [s for c in cuts for s in c.rejected] == seg.rejected


def _flat(cuts: list[Cut]) -> list:
    return [s for c in cuts for s in c.statements]


@_SETTINGS
@given(text=_SKILLS_TEXT, data=st.data())
def test_arbitrary_text_never_crashes_and_cuts_are_contiguous(text, data):
    pieces = _split(data, text)
    cuts, seg = _run(DRONE, pieces)
    _check_structure(DRONE, text, cuts, seg)


@_SETTINGS
@given(text=_CHAT_TEXT, data=st.data(), profile=st.sampled_from([CHAT, PARAGRAPH]))
def test_chat_text_cuts_are_contiguous(text, data, profile):
    cuts, seg = _run(profile, _split(data, text))
    _check_structure(profile, text, cuts, seg)
    assert all(s.kind == 'text' and s.text == s.text.strip() and s.text
               for s in _flat(cuts))
    assert seg.rejected == []


def _check_independent(profile: RobotProfile, text: str, pieces: list[str]) -> None:
    fine, fine_seg = _run(profile, list(text))
    coarse, coarse_seg = _run(profile, pieces)
    whole, _ = _run(profile, [text] if text else [])
    assert _flat(fine) == _flat(coarse) == _flat(whole)
    assert fine_seg.rejected == coarse_seg.rejected
    fine_ends = {c.end for c in fine}
    assert {c.end for c in coarse} <= fine_ends
    assert {c.end for c in whole} <= fine_ends
    # char by char every statement gets its own cut (skills and sentences complete one by one)
    assert all(len(c.statements) <= 1 for c in fine)
    # each coarse cut holds exactly the fine cuts it spans
    for cut in coarse:
        spanned = [c for c in fine if cut.start < c.end <= cut.end or (c.final and cut.final)]
        assert list(cut.statements) == [s for c in spanned for s in c.statements]
        assert list(cut.rejected) == [s for c in spanned for s in c.rejected]


@_SETTINGS
@given(text=_SKILLS_TEXT, data=st.data())
def test_skill_cuts_independent_of_split(text, data):
    _check_independent(DRONE, text, _split(data, text))


@_SETTINGS
@given(text=_CHAT_TEXT, data=st.data(), profile=st.sampled_from([CHAT, PARAGRAPH]))
def test_text_cuts_independent_of_split(text, data, profile):
    _check_independent(profile, text, _split(data, text))


# --- valid plans --------------------------------------------------------------------------------

_SP = st.sampled_from(['', ' ', '  '])
_WORD = st.from_regex(r'[A-Za-z_][A-Za-z0-9_]{0,6}( [A-Za-z0-9_]{1,5})?', fullmatch=True)
_QUOTED_BODY = st.text(alphabet='abc XYZ09()[]{};?=,.', max_size=10)


@st.composite
def _string_literal(draw) -> tuple[str, str]:
    form = draw(st.sampled_from(['single', 'double', 'bare']))
    if form == 'bare':
        word = draw(_WORD)
        return word, word
    body = draw(_QUOTED_BODY)
    quote = "'" if form == 'single' else '"'
    return f'{quote}{body}{quote}', body


_SHORTS = ('mf', 'tc', 's', 'g', 'iv', 'l', 'tp', 'd', 'move_forward')


@st.composite
def _call(draw, shorts: tuple[str, ...] = _SHORTS) -> tuple[str, tuple[str, dict]]:
    """Draw a valid call of one of ``shorts``: (text, (canonical skill, args))."""
    short = draw(st.sampled_from(shorts))
    sp = draw(_SP)
    if short in ('mf', 'move_forward'):
        value = draw(st.integers(20, 500))
        literal, args = str(value), {'distance': value}
    elif short == 'tc':
        value = draw(st.integers(1, 360))
        literal, args = f'+{value}' if draw(st.booleans()) else str(value), {'degrees': value}
    elif short == 'd':
        value = draw(st.integers(0, 600)) / 10
        literal, args = repr(value), {'seconds': value}
    elif short == 'tp':
        literal, args = '', {}
    else:
        literal, text = draw(_string_literal())
        args = {'text' if short == 'l' else 'object': text}
    canonical = DRONE.skill(short).name
    return f'{short}{sp}({sp}{literal}{sp})', (canonical, args)


def _statement(depth: int):
    simple = _call().map(lambda c: (c[0], 'skill', 1, [c[1]], (c[0], 'skill', 1, ())))
    if depth == 0:
        return simple
    return st.one_of(simple, _conditional(depth), _loop(depth))


@st.composite
def _body(draw, depth: int) -> tuple[str, list, tuple]:
    items = draw(st.lists(_statement(depth - 1), min_size=1, max_size=3))
    sep = draw(st.sampled_from([';', '; ', ';\n  ', '\n']))
    trailing = draw(st.sampled_from(['', ';']))
    text = '{' + draw(st.sampled_from(['', '\n '])) + sep.join(i[0] for i in items) + trailing
    return text + '}', [call for i in items for call in i[3]], tuple(i[4] for i in items)


@st.composite
def _conditional(draw, depth: int):
    cond_text, cond_call = draw(_call(('s', 'iv')))  # conditions are query skills
    compare = draw(st.sampled_from(['', '==True', ' != False', '>=3', "=='yes'", '<2.5']))
    body, calls, children = draw(_body(depth))
    text = f'?{cond_text}{compare}{draw(_SP)}{body}'
    return text, 'conditional', 1, [cond_call, *calls], (text, 'conditional', 1, children)


@st.composite
def _loop(draw, depth: int):
    count = draw(st.integers(1, 9))
    body, calls, children = draw(_body(depth))
    text = f'{count}{draw(_SP)}{body}'
    return text, 'loop', count, calls, (text, 'loop', count, children)


@_SETTINGS
@given(plan=st.lists(_statement(2), min_size=1, max_size=6),
       seps=st.lists(st.sampled_from([';', '; ', ';\n', '\n', ' \n\n']), min_size=6,
                     max_size=6),
       data=st.data())
def test_valid_plans_give_one_statement_per_top_level_statement(plan, seps, data):
    text = ''.join(item[0] + sep for item, sep in zip(plan, seps, strict=False))
    cuts, seg = _run(DRONE, _split(data, text))
    _check_structure(DRONE, text, cuts, seg)
    assert seg.rejected == []
    statements = _flat(cuts)
    assert [s.text for s in statements] == [item[0] for item in plan]
    assert [(s.kind, s.repeat) for s in statements] == [(item[1], item[2]) for item in plan]
    assert [[(c.skill, c.args) for c in s.calls] for s in statements] == [
        item[3] for item in plan]
    assert [_shape(s) for s in statements] == [item[4] for item in plan]
