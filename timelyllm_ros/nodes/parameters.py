"""Parameter descriptors and checks shared by the package's nodes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from rcl_interfaces.msg import (
    FloatingPointRange,
    IntegerRange,
    ParameterDescriptor,
    ParameterType,
    SetParametersResult,
)
from rclpy.parameter import Parameter

STR, INT, FLOAT, BOOL = (ParameterType.PARAMETER_STRING, ParameterType.PARAMETER_INTEGER,
                         ParameterType.PARAMETER_DOUBLE, ParameterType.PARAMETER_BOOL)


def describe(description: str, kind: int, read_only: bool = True,
             integer: tuple[int, int] | None = None,
             floating: tuple[float, float] | None = None) -> ParameterDescriptor:
    """A descriptor with its type and range; read-only unless a change takes effect live."""
    descriptor = ParameterDescriptor(description=description, type=kind, read_only=read_only)
    if integer is not None:
        descriptor.integer_range = [IntegerRange(from_value=integer[0], to_value=integer[1],
                                                 step=1)]
    if floating is not None:
        descriptor.floating_point_range = [FloatingPointRange(
            from_value=floating[0], to_value=floating[1], step=0.0)]
    return descriptor


def refuse_outside_choices(choices: Mapping[str, Sequence[str]]
                           ) -> Callable[[list[Parameter]], SetParametersResult]:
    """An on-set-parameters callback refusing a text parameter outside its choices, with the
    reason. rclpy itself checks types, ranges and read-only; register this before declaring,
    so that start-up values are checked too."""
    def check(parameters: list[Parameter]) -> SetParametersResult:
        for parameter in parameters:
            allowed = choices.get(parameter.name)
            if allowed is not None and parameter.value not in allowed:
                return SetParametersResult(
                    successful=False, reason=f'{parameter.name} must be one of '
                                             f'{", ".join(allowed)}, not {parameter.value!r}')
        return SetParametersResult(successful=True)
    return check
