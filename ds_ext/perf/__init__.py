"""Analytic communication / memory models shared by the planner, tests and benchmarks."""
