"""Benchmarks and learning comparisons (speed and memory are measured here, never by timed tests).

- ``train``: ``rlhf bench sft|rm``, training tokens/s and model FLOP utilisation of the engine;
- ``rlhf``: ``rlhf bench ppo|grpo``, samples/s of RL iterations by phase;
- ``trl_speed``: TRL's ``GRPOTrainer`` on the same workload (``python -m benchmarks.trl_speed``);
- ``learning``: held-out learning figures over seeds, variants side by side, ours and TRL's
  (``python -m benchmarks.learning``); ``trl_grpo`` runs TRL's ``GRPOTrainer`` as one of them.
"""
