"""Tasks (robot plan requests), their generation state and their segments."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from timelyllm_ros.core.tuf import Tuf
from timelyllm_ros.language.plan import SkillCall, Statement


class TaskStatus(enum.IntEnum):
    """Ordered: every status from FINISHED on is terminal, so "done" is one comparison."""

    WAITING = 0      # queued, no token generated yet (initial generation)
    RUNNING = 1      # in the engine's batch
    SUSPENDED = 2    # queued after a segment cut, token ids and KV kept
    GENERATED = 3    # generation ended, robot still executing
    FINISHED = 4     # generation ended and every segment executed
    FAILED = 5       # no executable plan, engine failure or robot failure
    CANCELLED = 6    # the client cancelled the goal
    KILLED = 7       # ended by the policy for overrunning its time budget (TimeBill's Kill)

    @property
    def terminal(self) -> bool:
        return self >= TaskStatus.FINISHED


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One plan request from a robot, as a workload or an action goal gives it."""

    task_id: str
    robot_id: str
    profile: str                       # robot profile name (tello, indy7, chatbot)
    task_class: str                    # metrics group: normal, urgent, arm, chatbot, ...
    task_type: str                     # finer group, e.g. the trace id 'T3'
    tuf: Tuf                           # TUF₀ of the request
    arrival_time: float                # s on the scheduler clock
    task: str                          # the task line of the prompt
    prompt_tokens: int                 # prompt length in tokens (fixed prefix + task line)
    task_tokens: int = 0               # tokens of the task line; the rest is the robot
                                       # kind's fixed prefix, shared under prefix caching
    script: tuple[str, ...] | None = None               # recorded output pieces (simulation)
    skill_times: tuple[tuple[str, float], ...] | None = None  # measured (skill, s), plan order


@dataclass(slots=True)
class Segment:
    """One dispatched segment s_k and its timing (float seconds on the scheduler clock)."""

    index: int
    text: str
    statements: tuple[Statement, ...]
    cut_time: float                    # generation of the segment ended
    dispatch_time: float               # sent to the robot (= cut time when streaming)
    estimated_exec_s: float            # minimum execution-time estimate
    tokens: int                        # output tokens in the segment
    is_last: bool = False
    start_time: float = math.nan       # robot started executing (reported)
    end_time: float = math.nan         # robot finished executing (reported)
    success: bool = True
    error: str = ''
    longest_exec_s: float = math.nan   # worst-case execution estimate (report deadline)

    @property
    def calls(self) -> tuple[SkillCall, ...]:
        return tuple(c for s in self.statements for c in s.calls)

    @property
    def exec_s(self) -> float:
        return self.end_time - self.start_time


@dataclass(slots=True)
class Generation:
    """The scheduler's state of one task: where its generation and its segments are."""

    spec: TaskSpec
    seq: int                                    # submission order (FIFO tie-break)
    status: TaskStatus = TaskStatus.WAITING
    k: int = 0                                  # index of the segment being generated
    need_time: float = 0.0                      # when the robot needs segment k (est.)
    tokens: int = 0                             # output tokens so far
    pieces: list[str] = field(default_factory=list)   # output text of each iteration
    segment_tokens: int = 0                     # tokens of the segment being generated
    segments: list[Segment] = field(default_factory=list)
    held: list[Statement] = field(default_factory=list)  # cut, not yet dispatched (no stream)
    held_text: str = ''
    rejected: list[str] = field(default_factory=list)    # malformed statements (errors)
    suspensions: int = 0
    preemptions: int = 0
    error: str = ''
    finish_reason: str = ''
    done_time: float = math.nan

    @property
    def task_id(self) -> str:
        return self.spec.task_id

    @property
    def ert_s(self) -> float:
        """ERT of the TUF governing segment k (TUF₀ for k = 0, TUF₁ has ERT 0)."""
        return self.spec.tuf.ert_s if self.k == 0 else 0.0
