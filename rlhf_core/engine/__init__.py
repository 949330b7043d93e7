"""The training engine: DeepSpeed (ZeRO 0-3) setup, the resumable loop and checkpoints.

DeepSpeed itself is imported lazily (``TrainEngine``, ``init_distributed``), so importing this
package is cheap.
"""

from rlhf_core.engine.checkpoint import CheckpointManager
from rlhf_core.engine.ds_config import WarmupDecay, build_ds_config
from rlhf_core.engine.engine import TrainEngine
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
    "build_ds_config",
    "fit",
]
