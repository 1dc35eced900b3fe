"""Where an SGLang EAGLE-3 decode cycle goes: draft, verify, draft-extend (benchmarks only).

Loaded into SGLang's scheduler process through ``forward_hooks`` (a hook factory that registers no
hook and instead wraps three methods of SGLang 0.5.17's spec-v2 worker once):
``EagleDraftWorker.draft`` (the drafter's K steps), ``EAGLEWorkerV2.verify`` (the target's forward
over the drafts and the acceptance) and ``EagleDraftWorker._draft_extend_for_decode`` (the drafter
fed the accepted tokens). Each call is bracketed by CUDA events on the current stream, so a part's
time is the stream's time from its first launch to its last kernel, gaps where the GPU waited for
the host's launches included (what a launch-bound decode spends); ``cycle`` runs from one draft's
start to the next one's. Nothing synchronizes: events are read once they have completed.
Totals go to ``<config.out>/cycle-<pid>.json`` every 50 cycles and are summed by ``read_cycles``.

    target.sglang.extra_engine_kwargs.forward_hooks=[{name: cycle, target_modules: [lm_head],
        hook_factory: "benchmarks.device.sglang_cycle_probe:factory", config: {out: /tmp/cycle}}]
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PARTS = ("draft", "verify", "draft_extend")
_STATE: dict[str, Any] = {}


def factory(config: dict[str, Any]):
    """SGLang's hook factory: wraps the worker's methods (once per process) and registers nothing."""
    if _STATE:
        return None
    import torch
    from sglang.srt.speculative import eagle_worker_v2 as w

    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    _STATE.update(pending=[], ms={p: 0.0 for p in (*PARTS, "cycle")}, calls={p: 0 for p in (*PARTS, "cycle")},
                  last_draft=None, path=out / f"cycle-{os.getpid()}.json", topk=None)

    def timed(part: str, fn):
        def wrapper(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():  # a CUDA-graph capture: no events in it
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if part == "draft":
                _STATE["topk"] = getattr(args[0], "topk", _STATE["topk"])  # 1: a chain; the tree's width
                if _STATE["last_draft"] is not None:
                    _STATE["pending"].append(("cycle", _STATE["last_draft"], start))
                _STATE["last_draft"] = start
            result = fn(*args, **kwargs)
            end.record()
            _STATE["pending"].append((part, start, end))
            _collect()
            return result

        return wrapper

    w.EagleDraftWorker.draft = timed("draft", w.EagleDraftWorker.draft)
    w.EAGLEWorkerV2.verify = timed("verify", w.EAGLEWorkerV2.verify)
    w.EagleDraftWorker._draft_extend_for_decode = timed("draft_extend", w.EagleDraftWorker._draft_extend_for_decode)
    return None


def _collect() -> None:
    """Add the events that have completed; dump the totals every 50 cycles."""
    still = []
    for part, start, end in _STATE["pending"]:
        if end.query():
            _STATE["ms"][part] += start.elapsed_time(end)
            _STATE["calls"][part] += 1
        else:
            still.append((part, start, end))
    _STATE["pending"] = still
    if _STATE["calls"]["cycle"] and _STATE["calls"]["cycle"] % 50 == 0:
        tmp = _STATE["path"].with_suffix(".tmp")
        tmp.write_text(json.dumps({"ms": _STATE["ms"], "calls": _STATE["calls"], "topk": _STATE["topk"]}))
        os.replace(tmp, _STATE["path"])


def read_cycles(out: str | Path, topk: int | None = None) -> dict[str, Any]:
    """Milliseconds per call of each part, over the scheduler processes that wrote to ``out`` (those
    of drafts ``topk`` wide only, when given: one engine per bench mode)."""
    ms = {p: 0.0 for p in (*PARTS, "cycle")}
    calls = {p: 0 for p in ms}
    for f in Path(out).glob("cycle-*.json"):
        data = json.loads(f.read_text())
        if topk is not None and data.get("topk") != topk:
            continue
        for p in ms:
            ms[p] += data["ms"].get(p, 0.0)
            calls[p] += data["calls"].get(p, 0)
    return {"ms_per_call": {p: ms[p] / calls[p] for p in ms if calls[p]}, "calls": calls}
