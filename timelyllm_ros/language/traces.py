"""LRTrace trace sets: per task, the robot, TUF class, prompt size and the generated plan.

A trace is replayed independently of the model that produced it (paper 000 §6): the simulated
engine emits its token pieces, the segmenter cuts them, simulated robots execute the skills.
The bundled set (``data/traces/derived.yaml``) is derived, not recorded; see its provenance.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from timelyllm_ros.errors import WorkloadError
from timelyllm_ros.language.profiles import load_profile
from timelyllm_ros.language.segmenter import segment_text
from timelyllm_ros.safe_files import DATA_FILE, WorkloadInputError, load_yaml, validation_problems

DATA_DIR = Path(__file__).resolve().parents[1] / 'data'   # the package's data
DERIVED_TRACES = DATA_DIR / 'traces' / 'derived.yaml'

# Roughly the granularity of Llama-3's BPE on plans: a word or up to three digits, with its
# leading space; punctuation in runs of at most two characters; other whitespace on its own.
_PIECE = re.compile(r' ?_?[A-Za-z]+| ?\d{1,3}| ?[^\sA-Za-z\d]{1,2}|\s')


def approx_tokenize(text: str) -> tuple[str, ...]:
    """Split text into token-sized pieces whose concatenation is exactly ``text``."""
    pieces = tuple(_PIECE.findall(text))
    assert ''.join(pieces) == text
    return pieces


class Trace(BaseModel):
    """One recorded (or derived) task: what was asked and what the LLM answered."""

    model_config = ConfigDict(extra='forbid', frozen=True)

    id: int = Field(ge=0)
    name: str
    robot: str                         # robot profile name
    task_class: str                    # normal, urgent, arm, chatbot, ...
    prompt_tokens: int = Field(gt=0, le=10_000_000)
    task: str = Field(min_length=1)
    plan: str = Field(min_length=1)
    tokens: tuple[str, ...] | None = None   # recorded pieces; approximated when absent

    @cached_property
    def pieces(self) -> tuple[str, ...]:
        return self.tokens if self.tokens is not None else approx_tokenize(self.plan)

    @property
    def task_type(self) -> str:
        return f'T{self.id}'


class TraceSet(BaseModel):
    """A trace set file: provenance plus traces by id."""

    model_config = ConfigDict(extra='forbid', frozen=True)

    provenance: str
    traces: list[Trace]

    @cached_property
    def by_id(self) -> dict[int, Trace]:
        return {t.id: t for t in self.traces}

    def get(self, trace_id: int) -> Trace:
        try:
            return self.by_id[trace_id]
        except KeyError:
            known = ', '.join(str(i) for i in sorted(self.by_id))
            raise WorkloadError(f'unknown trace id {trace_id}; known: {known}') from None


_CACHE: dict[str, TraceSet] = {}


def trace_set_path(name_or_path: str | Path) -> Path:
    """A bundled trace set by name (``derived``; ``heldback`` and ``heldback2``: robot tasks kept
    out of every prompt, for plan quality) or any trace-set YAML by path."""
    candidate = Path(name_or_path)
    if candidate.suffix in ('.yaml', '.yml'):
        return candidate
    return DATA_DIR / 'traces' / f'{candidate}.yaml'


def load_trace_set(path: str | Path = DERIVED_TRACES) -> TraceSet:
    """Load and check a trace set: every plan must segment into valid statements.

    Raises:
        WorkloadError: unreadable file, duplicate id, unknown robot profile, or a plan with a
            malformed statement.
        WorkloadInputError: a file too large, not UTF-8 YAML or not of the schema.
    """
    key = str(Path(path).resolve())
    if key in _CACHE:
        return _CACHE[key]
    try:
        data = load_yaml(path, WorkloadInputError, DATA_FILE)
    except OSError as err:
        raise WorkloadError(f'{path}: cannot read trace set: {err.strerror}') from None
    try:
        trace_set = TraceSet.model_validate(data)
    except ValidationError as err:
        raise WorkloadInputError(str(path), f'invalid trace set: {validation_problems(err)}'
                                 ) from None
    if len(trace_set.by_id) != len(trace_set.traces):
        raise WorkloadError(f'{path}: duplicate trace ids')
    for trace in trace_set.traces:
        try:
            profile = load_profile(trace.robot)
        except Exception as err:  # noqa: BLE001 - reported with the trace it concerns
            raise WorkloadError(f'{path}: trace {trace.id}: {err}') from None
        cuts = segment_text(profile, trace.plan)
        rejected = [s for cut in cuts for s in cut.rejected]
        if rejected or not any(cut.statements for cut in cuts):
            errors = '; '.join(f'{s.text!r}: {s.error}' for s in rejected) or 'no statement'
            raise WorkloadError(f'{path}: trace {trace.id} plan is not valid: {errors}')
    _CACHE[key] = trace_set
    return trace_set
