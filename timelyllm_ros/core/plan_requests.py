"""From a task to its engine request: the robot kind's prompt, plan grammar, shared prefix and
token limit; and the robot profiles a scheduler serves, each loaded once.

The scheduler asks this module for a goal's request when the goal is submitted; how a robot
kind is prompted and constrained is decided here, not in the scheduling loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from timelyllm_ros.core.request import TaskSpec
from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.language.grammar import plan_grammar
from timelyllm_ros.language.grounding import task_objects
from timelyllm_ros.language.profiles import NEXT_TASK, RobotProfile, load_profile

REPETITION_PENALTY = 1.1
"""Greedy decoding of plans lowers the logits of tokens already written by this factor: small
models otherwise repeat one statement up to the token limit (measured with
``timelyllm plan-quality`` on SmolLM2-135M)."""


def plan_request(profile: RobotProfile, request_id: str, task: str, *, prompt_tokens: int,
                 task_tokens: int = 0, script: tuple[str, ...] | None = None,
                 grammar: bool = False, zero_utility_s: float | None = None) -> EngineRequest:
    """The engine request of one task for a robot kind: its prompt (plain and as chat turns),
    token limit, the cacheable prefix of the kind, the decoding's repetition penalty, the end of
    the answer where a transcript would go on to another task, and with ``grammar`` the
    profile's plan grammar grounded in the task (objects named only from its scene and text),
    ended early rather than cut inside a statement at the token limit."""
    compiled = plan_grammar(profile, task_objects(task)) if grammar else None
    return EngineRequest(
        request_id=request_id, prompt=profile.build_prompt(task), prompt_tokens=prompt_tokens,
        max_tokens=profile.max_tokens, script=script,
        prefix_id=profile.name if task_tokens else None,
        prefix_tokens=prompt_tokens - task_tokens if task_tokens else 0,
        grammar=compiled.gbnf if compiled is not None else None,
        end_within=2 * profile.max_segment_tokens if compiled is not None else 0,
        messages=profile.build_messages(task), repetition_penalty=REPETITION_PENALTY,
        zero_utility_s=zero_utility_s, stop=NEXT_TASK,
    )


def task_request(profile: RobotProfile, spec: TaskSpec, *, grammar: bool) -> EngineRequest:
    """The engine request of a submitted task (see :func:`plan_request`)."""
    zero = spec.tuf.zero_s
    return plan_request(profile, spec.task_id, spec.task, prompt_tokens=spec.prompt_tokens,
                        task_tokens=spec.task_tokens, script=spec.script, grammar=grammar,
                        zero_utility_s=zero if math.isfinite(zero) else None)


class ProfileCache:
    """Robot profiles by name, each loaded once (from the bundled profiles, or any loader)."""

    def __init__(self, load: Callable[[str], RobotProfile] = load_profile) -> None:
        self._load = load
        self._profiles: dict[str, RobotProfile] = {}

    def __call__(self, name: str) -> RobotProfile:
        """The profile of a robot kind.

        Raises:
            ProfileError: no such profile, or one that does not load.
        """
        profile = self._profiles.get(name)
        if profile is None:
            profile = self._profiles[name] = self._load(name)
        return profile
