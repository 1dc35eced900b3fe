"""Disk preflight: refuse to start an extraction that would run out of disk midway."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from eagle3_ray.errors import PreflightError
from eagle3_ray.features.record import bytes_per_token

_GB = 1e9


@dataclass(frozen=True)
class PreflightReport:
    out_dir: Path
    checked_path: Path  # nearest existing ancestor of out_dir, whose filesystem was measured
    num_tokens: int
    projected_bytes: int
    required_bytes: int  # projected x margin
    free_bytes: int
    margin: float

    def summary(self) -> str:
        return (f"feature store at {self.out_dir}: {self.num_tokens} tokens -> "
                f"{self.projected_bytes / _GB:.2f} GB projected (x{self.margin} margin = "
                f"{self.required_bytes / _GB:.2f} GB), {self.free_bytes / _GB:.2f} GB free on {self.checked_path}")


def projected_bytes(num_tokens: int, hidden_size: int, compact: str = "none") -> int:
    """Shard bytes for ``num_tokens`` tokens of features (headers and markers are negligible)."""
    return num_tokens * bytes_per_token(hidden_size, compact)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_disk(
    out_dir: str | Path, num_tokens: int, hidden_size: int, margin: float = 1.1, compact: str = "none"
) -> PreflightReport:
    """Raise PreflightError unless the filesystem of ``out_dir`` has ``projected x margin`` bytes
    free. When resuming, pass only the tokens still to extract."""
    out = Path(out_dir)
    checked = _nearest_existing(out)
    free = shutil.disk_usage(checked).free
    projected = projected_bytes(num_tokens, hidden_size, compact)
    report = PreflightReport(out_dir=out, checked_path=checked, num_tokens=num_tokens,
                             projected_bytes=projected, required_bytes=int(projected * margin),
                             free_bytes=free, margin=margin)
    if report.required_bytes > free:
        raise PreflightError(
            f"not enough disk for the {report.summary()}. Free space there, pass another --out on a "
            f"larger disk, or extract fewer samples (data.max_samples / data.max_length)"
        )
    return report
