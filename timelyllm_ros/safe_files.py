"""Bounded reading of the files and arguments the project is given (issue 31).

Workload specs, authors' workloads, trace sets, robot profiles, calibrations, pose files and
engine option values come from users and other programs, and a hostile one must end in a
refusal with a reason, never in a process that eats memory, never returns or prints a
traceback. So every one of them is read and parsed here, bounded before it is parsed:

* at most ``max_bytes`` are read (``cap + 1`` to tell "too large"), so ``/dev/zero`` or a
  pipe that never ends is refused rather than read to exhaustion;
* the bytes must be UTF-8;
* YAML may nest at most ``max_depth`` levels, use at most ``max_aliases`` aliases and expand
  (every alias counted at the full size of what it names) to at most ``max_nodes`` nodes:
  the "billion laughs" is refused while it is being composed, before anything expands;
* JSON may nest at most ``max_depth`` levels, and its numbers are finite, bounded integers
  (no ``NaN``, ``Infinity`` or 5000-digit integers).

The parsed document is returned as ``Any``, as :func:`json.loads` returns it: its loader
validates its shape. What breaks a bound is an :class:`InputError` naming the source, the
field (where there is one) and the reason. Loaders raise it as the subclass their callers
already catch (:class:`WorkloadInputError` is a
:class:`~timelyllm_ros.errors.WorkloadError`, and so on).

The command lines run their commands through :func:`refusing_input`: refused input prints
``error: <source>: <field>: <reason>`` and exits 2, as argparse does for a bad argument; the
argparse types below give each numeric argument its range the same way.

The numbers inside a file are checked by its loader's pydantic model (finite, in range);
:func:`validation_problems` names the failing fields alike for every loader.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from timelyllm_ros.errors import (
    EngineError,
    ProfileError,
    RobotError,
    TimelyError,
    TraceFormatError,
    WorkloadError,
)


# -- the error -------------------------------------------------------------------------------
class InputError(TimelyError):
    """Input refused before use: a file or value that is too large, too deep, not UTF-8, not
    valid YAML/JSON, or holds a field out of range. The command lines exit 2 on it."""

    def __init__(self, source: str, reason: str, field: str = '') -> None:
        self.source = source
        self.field = field
        self.reason = reason
        super().__init__(': '.join(part for part in (source, field, reason) if part))


class WorkloadInputError(InputError, WorkloadError):
    """A workload spec, authors' workload or trace set refused."""


class ProfileInputError(InputError, ProfileError):
    """A robot profile file refused."""


class EngineInputError(InputError, EngineError):
    """A calibration file or an engine option refused."""


class RobotInputError(InputError, RobotError):
    """A robot's configuration file (object poses) refused."""


class TraceInputError(InputError, TraceFormatError):
    """Data recorded in a bag refused."""


ErrorType = type[InputError]


def refusing_input(command: Callable[[Any], int]) -> Callable[[Any], int]:
    """A CLI command whose refused input prints ``error: …`` on stderr and gives exit status 2.

    Wrap it for :func:`timelyllm_ros.errors.run_command`, which still turns every other
    :class:`~timelyllm_ros.errors.TimelyError` into ``ERROR: …`` and 1.
    """
    def run(args: Any) -> int:
        try:
            return int(command(args))
        except InputError as err:
            print(f'error: {err}', file=sys.stderr)
            return 2
    return run


def validation_problems(err: ValidationError, limit: int = 5) -> str:
    """A pydantic error as ``field: problem; …`` (at most ``limit``), never quoting the input."""
    problems = [f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg'][:200]}"
                for e in err.errors(include_input=False, include_url=False)]
    more = len(problems) - limit
    return '; '.join(problems[:limit]) + (f'; and {more} more' if more > 0 else '')


# -- bounds ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """How much of a file is parsed at most."""

    max_bytes: int = 1 << 20
    max_depth: int = 32
    max_nodes: int = 100_000        # YAML nodes once every alias is expanded
    max_aliases: int = 1_000        # YAML alias uses
    max_int_digits: int = 100       # JSON integers


YAML_FILE = Limits()
"""Specs, profiles, calibrations, poses: small hand-written files."""

DATA_FILE = Limits(max_bytes=64 << 20, max_nodes=2_000_000)
"""Recorded data (authors' workloads, trace sets): the bundled ones are under 1 MiB."""

VALUE_TEXT = Limits(max_bytes=4096, max_depth=8, max_nodes=1_000, max_aliases=0)
"""One value given as text (an engine option)."""


# -- reading ---------------------------------------------------------------------------------
def read_bytes(path: str | Path, error: ErrorType, limits: Limits = YAML_FILE) -> bytes:
    """At most ``limits.max_bytes`` of a file; of a ``.gz`` file, of its decompressed bytes
    (so a small file that inflates past the bound is refused before it has).

    Raises:
        OSError: the file cannot be opened or read (the caller names what it was reading).
        InputError: (as ``error``) the file is larger than the bound, or a broken gzip file.
    """
    try:
        with (gzip.open(path, 'rb') if Path(path).suffix == '.gz'
              else Path(path).open('rb')) as stream:
            raw = stream.read(limits.max_bytes + 1)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise error(str(path), f'not a readable gzip file ({err})', 'encoding') from None
    if len(raw) > limits.max_bytes:
        raise error(str(path), f'larger than {limits.max_bytes} bytes', 'size')
    return raw


def decode_utf8(raw: bytes, source: str, error: ErrorType) -> str:
    """The bytes as UTF-8 text.

    Raises:
        InputError: (as ``error``) bytes that are not UTF-8, naming the first bad byte.
    """
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError as err:
        raise error(source, f'not UTF-8 text (byte {err.start})', 'encoding') from None


def read_text(path: str | Path, error: ErrorType, limits: Limits = YAML_FILE) -> str:
    """A bounded UTF-8 text file (see :func:`read_bytes`, :func:`decode_utf8`)."""
    return decode_utf8(read_bytes(path, error, limits), str(path), error)


def load_yaml(path: str | Path, error: ErrorType, limits: Limits = YAML_FILE) -> Any:
    """A YAML file, read and parsed within ``limits`` (see :func:`parse_yaml`).

    Raises:
        OSError: the file cannot be opened or read.
        InputError: (as ``error``) too large, not UTF-8, not valid YAML or beyond a bound.
    """
    return parse_yaml(read_text(path, error, limits), str(path), error, limits)


def load_json(path: str | Path, error: ErrorType, limits: Limits = DATA_FILE,
              finite: bool = True) -> Any:
    """A JSON file, read and parsed within ``limits`` (see :func:`parse_json`).

    Raises:
        OSError: the file cannot be opened or read.
        InputError: (as ``error``) too large, not UTF-8, not valid JSON or beyond a bound.
    """
    return parse_json(read_text(path, error, limits), str(path), error, limits, finite)


# -- YAML ------------------------------------------------------------------------------------
class _Refused(Exception):
    """A bound broken while composing; carries the reason and where."""

    def __init__(self, reason: str, mark: yaml.Mark | None) -> None:
        where = f' at line {mark.line + 1}, column {mark.column + 1}' if mark else ''
        super().__init__(reason + where)


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, composing within :class:`Limits`.

    The composer is where aliases are resolved, as shared references to one node: nothing has
    expanded yet. Each node's expanded size (1 + its children's, an alias counting as the whole
    node it names) is kept as the node is completed, so a bomb is refused after reading its
    few lines, long before a constructor or a validator would walk the expansion. An alias to
    a node still being composed (a cycle) has no size yet and is refused too.
    """

    def __init__(self, text: str, limits: Limits) -> None:
        super().__init__(text)
        self._limits = limits
        self._depth = 0
        self._aliases = 0
        self._sizes: dict[int, int] = {}

    def _mark(self) -> yaml.Mark | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]  # untyped in the stubs
        mark: yaml.Mark | None = event.start_mark
        return mark

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        limits = self._limits
        if self.check_event(yaml.AliasEvent):
            mark = self._mark()
            self._aliases += 1
            if self._aliases > limits.max_aliases:
                raise _Refused(f'more than {limits.max_aliases} aliases', mark)
            node = super().compose_node(parent, index)
            if id(node) not in self._sizes:
                raise _Refused('an alias inside the node it names', mark)
            return node
        mark = self._mark()
        self._depth += 1
        if self._depth > limits.max_depth:
            raise _Refused(f'nested deeper than {limits.max_depth} levels', mark)
        node = super().compose_node(parent, index)
        self._depth -= 1
        size = 1
        if isinstance(node, yaml.SequenceNode):
            size += sum(self._sizes[id(child)] for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            size += sum(self._sizes[id(key)] + self._sizes[id(value)]
                        for key, value in node.value)
        if size > limits.max_nodes:
            raise _Refused(f'expands to more than {limits.max_nodes} nodes', mark)
        self._sizes[id(node)] = size
        return node


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error's problem and position, without the snippet of the file it would quote."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark
        where = f' at line {mark.line + 1}, column {mark.column + 1}' if mark else ''
        return f'{err.problem or err.context or "syntax error"}{where}'
    return type(err).__name__


def parse_yaml(text: str, source: str, error: ErrorType, limits: Limits = YAML_FILE) -> Any:
    """One YAML document, composed within ``limits`` and constructed by the safe constructor.

    Raises:
        InputError: (as ``error``) not valid YAML, a value that cannot be built (an integer
            of more digits than Python converts, a date out of range), or beyond a bound.
    """
    if len(text) > limits.max_bytes:
        raise error(source, f'longer than {limits.max_bytes} characters', 'size')
    loader = _BoundedLoader(text, limits)
    try:
        return loader.get_single_data()
    except _Refused as err:
        raise error(source, f'not valid YAML: {err}') from None
    except yaml.YAMLError as err:
        raise error(source, f'not valid YAML: {yaml_problem(err)}') from None
    except (ValueError, OverflowError) as err:    # int('9' * 5000), date(2001, 13, 1), ...
        raise error(source, f'not valid YAML: a value cannot be built: {str(err)[:120]}'
                    ) from None
    except RecursionError:    # only where the caller's own stack is nearly full already
        raise error(source, 'not valid YAML: nested too deeply') from None
    finally:
        loader.dispose()


# -- JSON ------------------------------------------------------------------------------------
class _NotANumber(ValueError):
    pass


def _no_constant(name: str) -> object:
    raise _NotANumber(f'{name} is not a number JSON allows')


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotANumber(f'{text[:40]} overflows a float')
    return value


def _depth(data: object) -> int:
    """Nesting depth of parsed JSON (iterative: the value may be as deep as the parser let it)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, depth)
            stack.extend((item, depth + 1) for item in value)
    return deepest


def parse_json(text: str, source: str, error: ErrorType, limits: Limits = DATA_FILE,
               finite: bool = True) -> Any:
    """JSON whose integers have at most ``max_int_digits`` and, with ``finite``, whose numbers
    are finite: no ``NaN``, ``Infinity`` or ``1e400``. A loader whose model checks every
    number (and so can name the field that holds a NaN) passes ``finite=False``.

    Python's parser is recursive and stops at its recursion limit (about 1000 levels) with a
    RecursionError; that, and any depth beyond ``max_depth`` found after parsing, is refused.

    Raises:
        InputError: (as ``error``) not valid JSON, a number out of bounds, or too deep.
    """
    if len(text) > limits.max_bytes:
        raise error(source, f'longer than {limits.max_bytes} characters', 'size')

    def bounded_int(digits: str) -> int:
        if len(digits.lstrip('-')) > limits.max_int_digits:
            raise _NotANumber(f'an integer of more than {limits.max_int_digits} digits')
        return int(digits)

    try:
        if finite:
            data = json.loads(text, parse_int=bounded_int, parse_constant=_no_constant,
                              parse_float=_finite_float)
        else:
            data = json.loads(text, parse_int=bounded_int)
    except json.JSONDecodeError as err:
        raise error(source, f'not valid JSON: {err}') from None
    except _NotANumber as err:
        raise error(source, f'not valid JSON: {err}') from None
    except RecursionError:
        raise error(source, f'not valid JSON: nested deeper than {limits.max_depth} levels'
                    ) from None
    if _depth(data) > limits.max_depth:
        raise error(source, f'not valid JSON: nested deeper than {limits.max_depth} levels')
    return data


# -- command-line arguments ------------------------------------------------------------------
def int_arg(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]`` (argparse exits 2 naming the option)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f'{text[:40]!r} is not an integer') from None
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f'must be >= {low}, got {value}')
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f'must be <= {high}, got {value}')
        return value
    parse.__name__ = 'integer'
    return parse


def float_arg(low: float = 0.0, high: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[low, high]`` (no nan, no inf)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f'{text[:40]!r} is not a number') from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f'must be a finite number, got {value}')
        if value < low:
            raise argparse.ArgumentTypeError(f'must be >= {low:g}, got {value:g}')
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f'must be <= {high:g}, got {value:g}')
        return value
    parse.__name__ = 'number'
    return parse


def int_list_arg(low: int | None = None, high: int | None = None,
                 max_items: int = 1000) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each in ``[low, high]``."""
    item = int_arg(low, high)

    def parse(text: str) -> list[int]:
        parts = [p for p in text.split(',') if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError('expected comma-separated integers, got none')
        if len(parts) > max_items:
            raise argparse.ArgumentTypeError(f'at most {max_items} values, got {len(parts)}')
        return [item(p) for p in parts]
    parse.__name__ = 'integer list'
    return parse


def new_path(text: str) -> str:
    """An argparse type: a path to be created (a file or a bag directory), whose directory
    must exist already.

    Checked when the arguments are parsed, so a typo in the directory is refused before any
    work starts and no partial output is left behind; no directory is created on a guess.
    """
    if not text:
        raise argparse.ArgumentTypeError('an empty path')
    parent = Path(text).parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f'directory {str(parent)!r} does not exist')
    return text


def output_file(text: str) -> str:
    """An argparse type: a file to be written (see :func:`new_path`), not a directory."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f'{text!r} is a directory, not a file to write')
    return new_path(text)
