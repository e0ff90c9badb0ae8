"""The chatbot: a text workload (sentences or paragraphs read by a person), no hardware.

It has no vendor backend: its segments are timed by reading speed, and the generic simulated
backend is the only one that opens it. Profiles ``chatbot`` and ``chatbot_paragraph``.
"""

from __future__ import annotations

from timelyllm_ros.robots.kind import RobotKind, register_kind


class ChatbotKind(RobotKind):
    """Text answers read by a person: simulated only, tasks classed by their urgency."""

    name = 'chatbot'
    category = 'chatbot'


KIND = register_kind(ChatbotKind())
