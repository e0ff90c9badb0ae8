"""Scheduling policies, chosen by name (or ``'package.module:Class'`` for an external one)."""

from __future__ import annotations

from timelyllm_ros.errors import PolicyError
from timelyllm_ros.plugins import load_class
from timelyllm_ros.policies.autellix import AutellixAtlasPolicy, AutellixPolicy
from timelyllm_ros.policies.base import Policy
from timelyllm_ros.policies.baselines import (
    SegmentedEdfPolicy,
    SegmentedFcfsPolicy,
    VllmPolicy,
    VllmStreamPolicy,
)
from timelyllm_ros.policies.continuum import ContinuumPolicy
from timelyllm_ros.policies.semantic import SemanticPolicy
from timelyllm_ros.policies.slice import SlicePolicy
from timelyllm_ros.policies.timebill import TimeBillPolicy, TimeBillSkipNextPolicy
from timelyllm_ros.policies.timelyllm import (
    TimelyLlmArtifactPolicy,
    TimelyLlmPolicy,
    TimelyLlmSharePolicy,
)

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (VllmPolicy, VllmStreamPolicy, SegmentedFcfsPolicy, SegmentedEdfPolicy,
                TimelyLlmPolicy, TimelyLlmSharePolicy, TimelyLlmArtifactPolicy,
                SemanticPolicy, AutellixPolicy, AutellixAtlasPolicy,
                TimeBillPolicy, TimeBillSkipNextPolicy, SlicePolicy, ContinuumPolicy)
}
PAPER_POLICIES = ('vllm', 'vllm-stream', 'seg-fcfs', 'seg-edf', 'timelyllm')
FLEET_POLICY = TimelyLlmSharePolicy.name
"""The policy a fleet runs unless one is named: ``timelyllm run``, ``lrtrace record`` and
``replay``, the planner node and the live service (``timelyllm``, Eq. 4, stays the paper's:
``bench``, ``reproduce`` and ``simulate()`` run it for reproduction)."""


def create_policy(name: str) -> Policy:
    """Instantiate a built-in policy by name, or an external one given as ``'pkg.mod:Class'``.

    Raises:
        PolicyError: unknown name, or the external class cannot be loaded or is no Policy.
    """
    if name in POLICIES:
        return POLICIES[name]()
    if ':' in name:
        policy: Policy = load_class(name, Policy, 'policy', PolicyError)()
        return policy
    raise PolicyError(f'unknown policy {name!r}; available: {", ".join(POLICIES)}')


def resolve_policy_names(spec: str) -> list[str]:
    """Expand ``'all'`` / ``'paper'`` / a comma-separated list into policy names."""
    if spec == 'all':
        return list(POLICIES)
    if spec == 'paper':
        return list(PAPER_POLICIES)
    names = [n.strip() for n in spec.split(',') if n.strip()]
    if not names:
        raise PolicyError('no policy given')
    for n in names:
        if n not in POLICIES and ':' not in n:
            raise PolicyError(f'unknown policy {n!r}; available: {", ".join(POLICIES)}')
    return names


__all__ = ['PAPER_POLICIES', 'POLICIES', 'Policy', 'create_policy', 'resolve_policy_names']
