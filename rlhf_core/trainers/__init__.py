"""Trainers: SFT and reward model on the DeepSpeed engine. Each takes ``log(metrics: dict, step: int)``."""
