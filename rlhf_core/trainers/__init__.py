"""The training stages on the DeepSpeed engine: ``sft``, ``rm`` and ``rlhf`` (PPO / GRPO, a package), with
``common`` (what they share: splits, fingerprints, resume-or-start, outputs). Each stage function takes
``(params, root, log)`` with ``log(metrics: dict, step: int)``; ``rlhf_core.stages.STAGES`` names them."""
