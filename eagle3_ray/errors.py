"""Exceptions a user can cause. Each message says what to change."""


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
