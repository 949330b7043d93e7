"""What every params section shares: unknown keys are errors, assignments are validated; and the error type."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem; the message names the file and key path."""


class ParamsFileMissing(ConfigError):
    """A params file named explicitly (``-p FILE``) does not exist: an input that is missing (exit 65), not a
    default to fall back on."""


class Section(BaseModel):  # a params section: an unknown key is an error naming its path
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
