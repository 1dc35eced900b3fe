"""Exceptions a user can cause. Each message says what to change."""

from pathlib import Path


class Eagle3Error(Exception):
    """Base class for every error this package raises on bad input or environment."""


class ConfigError(Eagle3Error):
    """The config (file or override) is invalid: the message names the key and the fix."""


class TargetLoadError(Eagle3Error):
    """The target model cannot be resolved or loaded."""


class DataError(Eagle3Error):
    """An input data file cannot be used at all (per-sample problems are quarantined instead)."""


class SampleRejected(Eagle3Error):
    """One sample is unusable; it goes to the rejects file with this message as its reason."""


class StoreError(Eagle3Error):
    """A feature store is missing, corrupt, or does not match the target/config."""


class PreflightError(Eagle3Error):
    """A stage refuses to start because it would fail midway (e.g. not enough disk)."""


class CheckpointError(Eagle3Error):
    """A checkpoint or exported drafter is missing, corrupt or from another config."""


class EngineError(Eagle3Error):
    """A capture/generation engine setting is invalid or the engine returned inconsistent data."""


class OutputInUse(Eagle3Error):
    """Another eagle3-ray process is writing the same output directory."""


def require_dir(path, what: str, want: str, error: type[Eagle3Error]) -> Path:
    """``path`` as a Path when it is an existing directory, else ``error`` naming the argument
    (``what``), what is wrong and what to pass instead (``want``)."""
    path = Path(path)
    if not path.exists():
        raise error(f"{what} {path} does not exist; {want}")
    if not path.is_dir():
        raise error(f"{what} {path} is a file, not a directory; {want}")
    return path
