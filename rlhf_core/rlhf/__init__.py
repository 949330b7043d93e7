"""Benchmarks and learning comparisons of the RL stage (moving to ``rlhf_core.bench``)."""
