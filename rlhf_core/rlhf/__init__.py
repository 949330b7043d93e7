"""The RLHF stage's machinery: PPO and GRPO on the DeepSpeed engine (see docs/rlhf.md).

- ``experience``: rollouts -> experience rows (masks, log-probs, values, scores), the buffer, advantages;
- ``ppo`` / ``grpo``: the losses on one micro-batch;
- ``trainer``: ``RLHFTrainer`` / ``train_rlhf`` (the loop, metrics, evaluation, outputs);
- ``checkpoint``: multi-engine resumable checkpoints;
- ``bench``: ``rlhf bench ppo|grpo``.

Submodules are imported lazily by their users (DeepSpeed and transformers load only when needed).
"""
