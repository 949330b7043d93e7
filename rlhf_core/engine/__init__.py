"""The training engine: DeepSpeed (ZeRO 0-3) setup, the resumable loop, checkpoints and atomic saves.

DeepSpeed itself is imported lazily (``TrainEngine``, ``init_distributed``), so importing this
package is cheap.
"""

from rlhf_core.engine.checkpoint import CheckpointManager, atomic_dir
from rlhf_core.engine.ds_config import WarmupDecay, build_ds_config, resolve_precision
from rlhf_core.engine.engine import TrainEngine, model_init_context
from rlhf_core.engine.errors import NonFiniteLossError, TrainingInputError
from rlhf_core.engine.loop import Hooks, TrainState, fit
from rlhf_core.engine.sampler import ResumableSampler, StepPlan

__all__ = [
    "CheckpointManager",
    "Hooks",
    "NonFiniteLossError",
    "ResumableSampler",
    "StepPlan",
    "TrainEngine",
    "TrainState",
    "TrainingInputError",
    "WarmupDecay",
    "atomic_dir",
    "build_ds_config",
    "fit",
    "model_init_context",
    "resolve_precision",
]
