"""LRTrace: robot task traces, execution-time models and programmable workloads (paper 000 §6)."""
