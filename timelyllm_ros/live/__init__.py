"""The live planner: goals checked at the gate, and the scheduler served on a wall clock
(what the ROS planner node wraps)."""
