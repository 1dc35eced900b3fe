"""Exceptions a user can cause. Each message says what to change."""

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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


class AuditFailed(Eagle3Error):
    """Captured hidden states fail the capture audit: they do not predict the target's next tokens the
    way the target does (docs/feature-store.md, "Capture audit"); the message names the shard, the
    figure, the worst sample and the likely causes."""


class PreflightError(Eagle3Error):
    """A stage refuses to start because it would fail midway (e.g. not enough disk)."""


class CheckpointError(Eagle3Error):
    """A checkpoint or exported drafter is missing, corrupt or from another config."""


class EngineError(Eagle3Error):
    """A capture/generation engine setting is invalid or the engine returned inconsistent data."""


class EngineStartError(EngineError):
    """An engine could not be built: its constructor raised, or a process it started (an SGLang
    scheduler) died while starting. Building it again would fail the same way, so the stage stops
    (exit status 2) and Ray does not retry it; the message names the cause on one line."""


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


def exception_line(e: BaseException, limit: int = 500) -> str:
    """``Type: message`` of ``e`` on one line (the message's lines joined with "; "), at most ``limit``
    characters: the cause as an error message quotes it."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = f"{type(e).__name__}: {'; '.join(lines)}" if lines else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def engine_start(what: str) -> Iterator[None]:
    """Building an engine (``what``: which one, for the message): an exception raised in the block
    leaves it as an ``EngineStartError`` naming ``what`` and the cause on one line, which the CLI
    prints as the stage's error (exit status 2), and which Ray does not retry (it is raised, not a
    crash). An ``Eagle3Error`` (a config or target the user must fix, already worded for them)
    passes as it is."""
    try:
        yield
    except Eagle3Error:
        raise
    except Exception as e:
        raise EngineStartError(f"{what} could not be built: {exception_line(e)}") from e
