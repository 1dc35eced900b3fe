"""The SGLang capture hook cut short, to find where the capture's cost lies (benchmarks only).

``benchmarks/device/sglang_capture.py --probes rows,copy`` loads ``factory`` into SGLang's scheduler
processes in place of the product's ``logits_processor`` hook (``probe_hooks`` swaps it into a
capture engine's ``forward_hooks``). The probe runs the product hook's own steps
(``eagle3_ray.engines.sglang_hooks``) up to its cut:

- ``rows``: the batch's rows gathered on the device (the aux states packed [N, 3H], the layer hooks'
  parked rows taken), then nothing;
- ``copy``: also their non-blocking copy to pinned host memory, handed to the hook's writer thread,
  which waits for the copy and writes no file.

``read_writer_stats``: the writer's account that a scheduler process last wrote next to the captures
(``sglang_hooks.STATS_FILE``), read around a measurement.

    forward_hooks=probe_hooks(engine_kwargs(target, "capture", capture_dir=d)["forward_hooks"], "copy")
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from eagle3_ray.engines import sglang_hooks as hooks

PROBES = ("rows", "copy")
FACTORY_PATH = "benchmarks.device.sglang_capture_probe:factory"


def factory(config: dict[str, Any]) -> Callable | None:
    """``hook_factory`` of the probe: the product hook's config plus ``probe``, one of PROBES."""
    probe = config["probe"]
    if probe not in PROBES:
        raise ValueError(f"capture probe {probe!r} is not one of {PROBES}")
    if hooks.world_rank() % int(config["tp_size"]) != 0:
        return None
    directory = Path(config["dir"])
    directory.mkdir(parents=True, exist_ok=True)
    slots, key = int(config.get("layer_slots", 0)), str(directory)

    def hook(module: Any, args: tuple, output: Any) -> None:
        t0 = time.perf_counter()
        batch = hooks.batch_rows(args, slots, key)
        if batch is None or probe == "rows":
            return None
        _, hidden, aux = batch
        host_aux, host_last, ready = hooks.to_host(aux, hidden)
        hooks.writer().put(directory, [], host_aux, host_last, ready, t0)  # no requests: no file
        return None

    return hook


def probe_hooks(forward_hooks: list[dict[str, Any]], probe: str) -> list[dict[str, Any]]:
    """A capture engine's ``forward_hooks`` with the product's ``logits_processor`` hook replaced by
    the probe ``probe`` (the layer hooks stay: they park the rows the probe takes)."""
    return [{**h, "hook_factory": FACTORY_PATH, "config": {**h["config"], "probe": probe}}
            if h["hook_factory"] == hooks.FACTORY_PATH else h for h in forward_hooks]


def read_writer_stats(directory: str | Path) -> dict | None:
    """The writer's account (``sglang_hooks._Writer.stats``) a scheduler process last wrote into the
    capture ``directory``; None before its first batch."""
    try:
        return json.loads((Path(directory) / hooks.STATS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
