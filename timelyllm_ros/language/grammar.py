"""Plan grammars: a robot profile compiled to a GBNF grammar for constrained decoding.

A constrained model can only write plans the segmenter accepts and the robot can run: the
profile's own skills, each with its number of arguments; numbers of the argument's type inside
its limits (no exponent, no ``nan``); quoted strings of at most :data:`MAX_STRING_CHARS`
printable characters (a letter or digit first, then letters, digits, space, ``_-.,:?!/+``);
conditions that call a query skill; loops whose counts (multiplied when nested) stay within
``max_loop_count``; bodies nested at most ``max_nesting_depth`` deep; and the end of text only
after a complete statement. Statements are separated by ``;`` (optionally followed by a
newline); the last statement may be followed by a ``;``, a newline or both, which end the plan; the
grammar writes no other whitespace, which keeps plans short.

The text is GBNF (llama.cpp's grammar format): llama.cpp's grammar sampler reads it as is,
llguidance and vLLM's structured outputs read GBNF too, so one grammar serves every engine.
Text-segmented profiles (the chatbot) have no grammar: their answers are free text.

Bounded counts are written as rule alternatives, not as a counter: a loop of count ``c`` inside
a loop budget ``r`` opens a body whose budget is ``r // c``, and each (depth, budget) pair has
its own statement rule; there are O(depth * sqrt(max_loop_count)) of them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from timelyllm_ros.language.grounding import OBJECT_ARGS, PLACE_PREFIXES
from timelyllm_ros.language.profiles import (
    FlightRule,
    GripperRule,
    RobotProfile,
    Skill,
    SkillArg,
)
from timelyllm_ros.recently_used import recently_used

MAX_STRING_CHARS = 40
"""Longest string argument a constrained plan may hold (characters between the quotes)."""

MAX_FRACTION_DIGITS = 3
"""Digits after the decimal point of a float argument in a constrained plan."""

UNBOUNDED = 10**9 - 1
"""Magnitude bound of a number argument the profile gives no limit (keeps numbers finite)."""

_STRING_CHARS = '-a-zA-Z0-9 _.,:?!/+'   # a GBNF class: words, names, short questions

_COMPARISONS = ('==', '!=', '<=', '>=', '<', '>')


@dataclass(frozen=True, slots=True)
class PlanGrammar:
    """The grammar of one robot kind's plans.

    Attributes:
        profile: The profile's name.
        gbnf: The grammar in GBNF, start rule ``root``.
    """

    profile: str
    gbnf: str


def plan_grammar(profile: RobotProfile,
                 objects: Sequence[str] | None = None) -> PlanGrammar | None:
    """The profile's plan grammar; ``None`` for free-text profiles.

    With ``objects`` (a task's, :func:`~timelyllm_ros.language.grounding.task_objects`) the
    grammar is grounded in the goal: an argument that names a thing (``object``, ``where``)
    is one of them (a ``where`` also ``near_`` or ``on_`` one), and a skill that needs such
    an argument cannot be written when there is none. Compiled once per profile and object
    set (the last :data:`GRAMMAR_CACHE_SIZE`: goals of one scene share theirs).
    """
    if profile.segmentation != 'skills':
        return None
    key = (id(profile), None if objects is None else tuple(objects))
    return recently_used(
        _CACHE, key, lambda: (profile, PlanGrammar(profile=profile.name,
                                                   gbnf=_GrammarWriter(profile, key[1]).write())),
        GRAMMAR_CACHE_SIZE, fresh=lambda cached: cached[0] is profile)[1]


GRAMMAR_CACHE_SIZE = 256
"""Grammars kept (per profile and object set)."""

_CACHE: OrderedDict[tuple[int, tuple[str, ...] | None],
                    tuple[RobotProfile, PlanGrammar]] = OrderedDict()


def _literal(text: str) -> str:
    """A GBNF string literal."""
    escaped = text.replace('\\', '\\\\').replace('"', '\\"').replace('\n', '\\n')
    return f'"{escaped}"'


def _characters(text: str) -> str:
    """A literal written one character at a time: llguidance lexes each quoted literal as one
    lexeme, and ``"-175"`` as one lexeme would hide ``"-" "1" "7" "4"``."""
    return ' '.join(_literal(char) for char in text)


def _alternatives(options: Iterable[str]) -> str:
    return ' | '.join(f'({option})' if ' | ' in option else option for option in options)


def _digits_range(low: str, high: str) -> list[str]:
    """GBNF sequences matching every decimal string between two of equal length."""
    if len(low) == 1:
        return [_literal(low) if low == high else f'[{low}-{high}]']
    if low[0] == high[0]:
        return [f'{_literal(low[0])} {tail}' for tail in _digits_range(low[1:], high[1:])]
    rest = len(low) - 1
    any_tail = ' '.join(['[0-9]'] * rest)
    out: list[str] = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != '0' * rest:
        out += [f'{_literal(low[0])} {tail}' for tail in _digits_range(low[1:], '9' * rest)]
        first += 1
    tail_high: list[str] = []
    if high[1:] != '9' * rest:
        tail_high = [f'{_literal(high[0])} {tail}'
                     for tail in _digits_range('0' * rest, high[1:])]
        last -= 1
    if first <= last:
        lead = _literal(str(first)) if first == last else f'[{first}-{last}]'
        out.append(f'{lead} {any_tail}')
    return out + tail_high


def _natural_range(low: int, high: int) -> list[str]:
    """GBNF sequences matching the integers ``low..high`` (``0 <= low``), no leading zero."""
    out: list[str] = []
    for width in range(len(str(low)), len(str(high)) + 1):
        start = max(low, 10 ** (width - 1) if width > 1 else 0)
        end = min(high, 10**width - 1)
        if start <= end:
            out += _digits_range(str(start), str(end))
    return out


def integer_range(low: int, high: int) -> str:
    """A GBNF expression matching the decimal integers ``low..high`` (``-`` for negatives)."""
    if low > high:
        raise ValueError(f'empty range {low}..{high}')
    options: list[str] = []
    if low < 0:
        magnitudes = _natural_range(max(1, -high), -low)
        options.append(f'"-" ({_alternatives(magnitudes)})')
    if high >= 0:
        options += _natural_range(max(0, low), high)
    return _alternatives(options)


def float_range(low: float, high: float) -> str:
    """A GBNF expression matching decimal numbers inside ``low..high``.

    Integer parts are the integers inside the range; a fraction of up to
    :data:`MAX_FRACTION_DIGITS` digits may follow every integer part except the one at the
    range's end (``60`` or ``60.0`` for a maximum of 60, never ``60.5``).
    """
    first, last = math.ceil(low), math.floor(high)
    if first > last:
        raise ValueError(f'no integer inside {low}..{high}')
    fraction = '("." [0-9]' + ' [0-9]?' * (MAX_FRACTION_DIGITS - 1) + ')?'
    exact_zero = '("." "0")?'
    options: list[str] = []
    if last >= 0:
        top = max(first, 0)
        if top <= last - 1:
            options.append(f'({integer_range(top, last - 1)}) {fraction}')
        options.append(f'{_characters(str(last))} {exact_zero}')
    if first < 0:
        bottom = min(last, -1)       # the negative end nearest zero
        if first + 1 <= bottom:
            # -m.f lies below -m: fractions only on magnitudes short of the range's end.
            options.append(f'"-" ({integer_range(-bottom, -first - 1)}) {fraction}')
        options.append(f'{_characters(str(first))} {exact_zero}')
    return _alternatives(options)


class _GrammarWriter:
    """Writes the GBNF rules of one profile.

    With a gripper rule and the task's objects, the plan is a sequence that follows the hand:
    empty, or holding object *i*. Taking is written only as a reach and a take of one object
    (``move_to('cup');pick('cup')``) with an empty hand, putting only as a reach and a put of
    the held object there (``move_to('tray');place('cup','tray')``); letting go empties the
    hand. A condition of the top level entered with an empty hand is such a sequence that
    ends empty; every other body keeps the hand as it is (no take, put or letting go).

    With a flight rule, a landing is written only as a statement of the plan's top level, and
    after it only the skills done on the ground until a takeoff: ``mf(50);ld();l('down')``,
    ``ld();to();mf(50)``, never ``ld();mf(50)`` nor ``3{mf(50);ld()}``.
    """

    def __init__(self, profile: RobotProfile, objects: tuple[str, ...] | None = None) -> None:
        self.profile = profile
        self.objects = objects          # None: any string names a thing
        # the hand's state needs the things it can hold: a grounded grammar's objects
        self.gripper: GripperRule | None = profile.gripper if objects else None
        self.flight: FlightRule | None = profile.flight
        self.rules: dict[str, str] = {}

    def write(self) -> str:
        profile = self.profile
        if self.gripper is not None:
            plan = self._sequence('e', 0, profile.max_loop_count, closed=False)
        elif self.flight is not None:
            plan = self._flight(self.flight)
        else:
            top = self._statement(0, profile.max_loop_count)
            plan = f'{top} (sep {top})*'
        self.rules['sep'] = '";" "\\n"?'
        self.rules['string'] = (f'"\'" [a-zA-Z0-9] [{_STRING_CHARS}]{{0,{MAX_STRING_CHARS - 1}}} '
                                '"\'"')
        self.rules['number'] = ('"-"? [0-9]{1,9} ("." [0-9]{1,' + str(MAX_FRACTION_DIGITS)
                                + '})?')
        self.rules['literal'] = '"True" | "False" | number | string'
        operators = _alternatives(_literal(op) for op in _COMPARISONS)
        self.rules['comparison'] = f'({operators}) literal'
        # The plan may end after a separator (tokenizers merge ");" into one token: without
        # it the end of text would never be allowed at a token boundary), and a newline there
        # ends it: small models go on with another "Task:" instead. The end is the separator
        # rule itself: a ";" of its own beside it was a second lexeme for the same text, and
        # llguidance then refused a plan ending ";\n".
        ordered = {'root': f'" "? {plan} (sep | "\\n")?', **self.rules}
        return ''.join(f'{name} ::= {body}\n' for name, body in ordered.items())

    def _statement(self, depth: int, budget: int, hand: str = '') -> str:
        """The rule of a statement at a depth (0: top level) inside loops allowing ``budget``
        repetitions; ``hand`` under a gripper rule: ``e`` (in a sequence, hand empty), ``hs``
        (in a sequence, holding) or ``k`` (in a body that keeps the hand as it is)."""
        name = f'stmt-{hand}{"-" if hand else ""}{depth}-{budget}'
        if name in self.rules:
            return name
        self.rules[name] = ''                      # reserved: rules refer to each other
        options = [self._calls(query_only=False, hand=hand)]
        if depth + 1 <= self.profile.max_nesting_depth:
            # With a gripper, a condition of the plan's top level may take and put inside
            # (``?check('x')==True{move_to('x');pick('x');...;place(...)}``) when the hand is
            # empty; every other body keeps the hand as it is. (Every body taking and putting
            # was tried: its grammar grew to 280 kB for seven objects, 650 ms to compile.)
            inside = hand and 'k'
            conditional = 'e' if hand == 'e' and depth == 0 else inside
            body = self._body(depth + 1, budget, conditional)
            query = self._calls(query_only=True)
            if self.rules[query]:      # a grounded grammar without objects may have none
                options.append(f'"?" {query} comparison? {body}')
            counts: dict[int, list[int]] = {}
            for count in range(1, budget + 1):
                counts.setdefault(budget // count, []).append(count)
            for inner, group in sorted(counts.items()):
                loop_body = self._body(depth + 1, inner, inside)
                options.append(f'({integer_range(min(group), max(group))}) {loop_body}')
        self.rules[name] = _alternatives(options)
        return name

    def _body(self, depth: int, budget: int, hand: str = '') -> str:
        name = f'body-{hand}{"-" if hand else ""}{depth}-{budget}'
        if name not in self.rules:
            self.rules[name] = ''
            if hand == 'e':
                self.rules[name] = f'"{{" {self._sequence("e", depth, budget, closed=True)} "}}"'
            else:
                statement = self._statement(depth, budget, hand)
                self.rules[name] = f'"{{" {statement} (sep {statement})* "}}"'
        return name

    def _sequence(self, state: str, depth: int, budget: int, closed: bool) -> str:
        """Statements from a hand state (``e``, or ``0``, ``1``, ...: holding that object) on:
        ``closed``, they end with the hand empty (a body); else anywhere (the plan).

        A reach is written here, not among the statements, and what follows it decides
        whether it was a take's or a put's: an object named by two parallel paths (the
        statements' object rule and a take's literal) would be two lexemes for one text,
        which llguidance's lexer does not follow."""
        # one open sequence (the plan) and one closed (the top level's conditions): neither
        # depth nor budget varies, so the names leave them out (the grammar is shorter)
        name = f'seq-{"c" if closed else "o"}-{state}'
        assert (depth, closed) in ((0, False), (1, True)), (depth, closed)
        if name in self.rules:
            return name
        self.rules[name] = ''
        assert self.gripper is not None and self.objects is not None
        gripper, objects = self.gripper, self.objects

        def tail(state_after: str) -> str:
            """The rule of what may follow a statement that leaves the hand in a state."""
            rest = self._sequence(state_after, depth, budget, closed)
            after = f'then-{rest[4:]}'
            if after not in self.rules:
                self.rules[after] = (f'sep {rest}' if closed and state_after != 'e'
                                     else f'(sep {rest})?')
            return after

        if state == 'e':
            options = [f'{self._statement(depth, budget, "e")} {tail("e")}']
            for index in range(len(objects)):
                reach, take = self._hand_rules(index)[:2]
                options.append(f'{reach} ((sep {take} {tail(str(index))}) | {tail("e")})')
        else:
            held = int(state)
            options = [f'{self._statement(depth, budget, "hs")} {tail(state)}',
                       f'{_literal(self._short(gripper.open) + "()")} {tail("e")}']
            put = self._hand_rules(held)[2]
            for index in range(len(objects)):
                reach, _, _, spot = self._hand_rules(index)
                if index == held:
                    options.append(f'{reach} {tail(state)}')
                else:
                    options.append(f'{reach} ((sep {put} {spot} {tail("e")}) | {tail(state)})')
        self.rules[name] = _alternatives(options)
        return name

    def _flight(self, flight: FlightRule) -> str:
        """The plan under a flight rule: statements that do not land (the calls leave the
        landing out), then maybe a landing; after it, calls done on the ground, and maybe a
        takeoff and the same again."""
        top = self._statement(0, self.profile.max_loop_count)
        on_ground = [s for s in self.profile.skills if s.name in flight.on_ground]
        ground = ''
        if on_ground:                   # an empty rule would not compile
            self.rules['ground-call'] = _alternatives(self._skill_call(s.short, s.args)
                                                      for s in on_ground)
            ground = '(sep ground-call)* '
        land = _literal(self._short(flight.land) + '()')
        takeoff = _literal(self._short(flight.takeoff) + '()')
        self.rules['flying'] = f'({top} (sep {top})* (sep landed)?) | landed'
        self.rules['landed'] = f'{land} {ground}(sep {takeoff} (sep flying)?)?'
        return 'flying'

    def _hand_rules(self, index: int) -> tuple[str, str, str, str]:
        """The rules naming object ``index`` in the hand's calls: its reach, its take, the head
        of a put of it (``place('cup',``) and a put's place at it (``'near_cup')``). Written
        once and referred to: a sequence names every pair of held object and place."""
        assert self.gripper is not None and self.objects is not None
        names = (f'reach-{index}', f'take-{index}', f'put-{index}', f'at-{index}')
        if names[0] not in self.rules:
            thing = _literal(self.objects[index])
            places = _alternatives(_literal(prefix) for prefix in PLACE_PREFIXES)
            self.rules[names[0]] = self._named(self.gripper.reach, thing)
            self.rules[names[1]] = self._named(self.gripper.take, thing)
            put = _literal(self._short(self.gripper.put) + '(')
            self.rules[names[2]] = f'{put} "\'" {thing} "\'" ","'
            self.rules[names[3]] = f'"\'" ({places})? {thing} "\'" ")"'
        return names

    def _short(self, skill: str) -> str:
        return self.profile.skill(skill).short

    def _named(self, skill: str, *names: str) -> str:
        """A call of a skill whose arguments are these object names (or places)."""
        quoted = ' "," '.join(f'"\'" {name} "\'"' for name in names)
        return f'{_literal(self._short(skill) + "(")} {quoted} ")"'

    def _calls(self, query_only: bool, hand: str = '') -> str:
        name = 'query-call' if query_only else f'call{"-" if hand else ""}{hand}'
        if name in self.rules:
            return name
        barred: set[str] = set()
        if self.flight is not None and not query_only:
            barred.add(self.flight.land)      # a landing is the plan's own (``_flight``)
        if hand and self.gripper is not None:
            # Taking and putting are written by a sequence (after a reach), and so are a
            # reach and letting go while holding; a body that keeps the hand (k) neither
            # takes, puts nor lets go.
            barred = {self.gripper.take, self.gripper.put}
            if hand in ('e', 'hs'):
                barred.add(self.gripper.reach)
            if hand in ('k', 'hs'):
                barred.add(self.gripper.open)
        skills: list[Skill] = [
            s for s in self.profile.skills if (s.query or not query_only)
            and (self.objects or not self._names_things(s.args)) and s.name not in barred]
        self.rules[name] = _alternatives(self._skill_call(s.short, s.args) for s in skills)
        return name

    def _skill_call(self, short: str, args: list[SkillArg]) -> str:
        pieces = [_literal(short + '(')]
        for number, arg in enumerate(args):
            if number:
                pieces.append('","')
            pieces.append(self._argument(arg))
        pieces.append('")"')
        return ' '.join(pieces)

    def _names_things(self, args: list[SkillArg]) -> bool:
        """Whether a grounded grammar must draw one of these arguments from the objects."""
        return self.objects is not None and any(
            a.type == 'str' and a.name in OBJECT_ARGS for a in args)

    def _argument(self, arg: SkillArg) -> str:
        if arg.type == 'str' and self.objects is not None and arg.name in OBJECT_ARGS:
            if 'object-name' not in self.rules:
                names = _alternatives(_literal(name) for name in self.objects)
                places = _alternatives(_literal(prefix) for prefix in PLACE_PREFIXES)
                self.rules['object-name'] = names
                self.rules['object'] = '"\'" object-name "\'"'
                self.rules['place'] = f'"\'" ({places})? object-name "\'"'
            return 'place' if arg.name == 'where' else 'object'
        if arg.type == 'str':
            return 'string'
        name = f'arg-{arg.type}-{_rule_word(arg.min)}-{_rule_word(arg.max)}'
        if name not in self.rules:
            low = -UNBOUNDED if arg.min is None else arg.min
            high = UNBOUNDED if arg.max is None else arg.max
            if arg.type == 'int':
                self.rules[name] = integer_range(math.ceil(low), math.floor(high))
            else:
                self.rules[name] = float_range(low, high)
        return name


def _rule_word(bound: float | None) -> str:
    """A number as a GBNF rule name allows it (letters, digits, dashes)."""
    if bound is None:
        return 'any'
    return f'{bound:g}'.replace('-', 'n').replace('.', 'p').replace('+', '')
