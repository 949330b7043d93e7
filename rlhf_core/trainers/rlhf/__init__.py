"""The RLHF stage: PPO and GRPO on the DeepSpeed engine (see docs/rlhf.md), in the order of one iteration.

- ``inputs``: checks and prompts (train, held-out, ptx rows);
- ``models``: actor, reference and critic;
- ``experience``: rollouts -> experience rows (masks, log-probs, values, scores, baselined scores), the buffer;
- ``algorithms``: one declaration per algorithm (GRPO, PPO with GAE / RLOO / REINFORCE++): its needs, its
  baseline and advantages, its loss terms;
- ``ppo``: the actor and critic losses on one micro-batch;
- ``metrics``: per-iteration metrics reduced by name, the stage's summary;
- ``ema``, ``checkpoint``: EMA weights, multi-engine resumable checkpoints;
- ``build``: all of the above built once into an ``RLHFBundle`` (config, data, tokenizer, models, engines);
- ``trainer``: ``RLHFTrainer`` / ``train_rlhf``, the loop (collect -> advantages -> update -> log);
- ``outputs``: the models, metrics and plots the stage leaves.

Submodules are imported lazily by their users (DeepSpeed and transformers load only when needed).
"""
