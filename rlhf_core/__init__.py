"""rlhf_core: the ML library of rlhf-ops (config, data, models, algos, trainers, stages).

Free of Prefect by design; see ``docs/architecture.md``.
"""

__version__ = "0.1.0"
