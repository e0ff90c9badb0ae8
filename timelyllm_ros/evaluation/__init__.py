"""Evaluation tools beside the core: the simulated fleet and its workloads, benchmarks,
calibration, simulator validation, paper-claim reproduction, plan quality, metrics, plots and
tables."""
