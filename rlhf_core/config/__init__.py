"""Validated configuration: ``params.yaml`` is the single source of truth.

Every section is a pydantic model with ``extra="forbid"``, so an unknown key,
a wrong type or an out-of-range value fails with an error that names the key
path (``sft.lr: Input should be greater than 0``).  ``-S key.path=value``
overrides mirror ``dvc exp run -S``: the value is parsed as YAML.

The sections, one module each (import them from here, ``rlhf_core.config``):

- ``data``: ``DataConfig`` and its sources, columns, generators;
- ``model``: ``ModelConfig`` (and the tiny demo model), ``ComputeConfig`` (and LoRA);
- ``training``: the optimiser sections, ``SFTConfig``, ``RMConfig``;
- ``rl``: ``RLHFConfig``, ``PPOConfig``, ``GRPOConfig``;
- ``evaluation``: ``EvalConfig``, ``GatesConfig``;
- ``feedback``: ``FeedbackConfig`` (continuous RLHF rounds);
- ``params``: ``Params`` (with ``project`` and ``tracking``), ``for_round``;
- ``loading``: ``load_params``, ``validate``, ``-S`` overrides; ``base``: ``ConfigError``, the section base class.
"""

from rlhf_core.config.base import ConfigError, ParamsFileMissing
from rlhf_core.config.data import (
    ArithmeticDataConfig,
    ColumnMap,
    DataConfig,
    DemoDataConfig,
    PhaseFiles,
    SourceConfig,
)
from rlhf_core.config.evaluation import EvalConfig, GatesConfig
from rlhf_core.config.feedback import FeedbackConfig, LabelColumns
from rlhf_core.config.loading import DEFAULT_PARAMS, apply_overrides, load_params, parse_override, validate
from rlhf_core.config.model import ComputeConfig, LoraConfig, ModelConfig, TinyModelConfig
from rlhf_core.config.params import Params, ProjectConfig, TrackingConfig, for_round
from rlhf_core.config.rl import GRPOConfig, PPOConfig, RLHFConfig
from rlhf_core.config.training import EpochConfig, OptimConfig, RMConfig, SFTConfig

__all__ = [
    "DEFAULT_PARAMS",
    "ArithmeticDataConfig",
    "ColumnMap",
    "ComputeConfig",
    "ConfigError",
    "ParamsFileMissing",
    "DataConfig",
    "DemoDataConfig",
    "EpochConfig",
    "EvalConfig",
    "FeedbackConfig",
    "GRPOConfig",
    "GatesConfig",
    "LabelColumns",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "PPOConfig",
    "Params",
    "PhaseFiles",
    "ProjectConfig",
    "RLHFConfig",
    "RMConfig",
    "SFTConfig",
    "SourceConfig",
    "TinyModelConfig",
    "TrackingConfig",
    "apply_overrides",
    "for_round",
    "load_params",
    "parse_override",
    "validate",
]
