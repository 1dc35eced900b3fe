"""The capture audit's faults (tests/audit_faults.py) inside a real SGLang engine: forward hooks that break
what the capture hook reads, the way a bug in the SGLang capture path would (issue 61). Test and benchmark
support only (benchmarks/capture_audit.py --backend sglang --faults; tests/test_sglang_audit_faults.py);
the library has no fault switch.

SGLang registers every ``ServerArgs.forward_hooks`` spec in each scheduler process, in list order, so
the specs here go before the capture's own and change a module's output before the capture hook on
``logits_processor`` sees it. The scheduler imports this module by name: its directory (tests/) must be
on the path of the process that starts the engine (a spawned scheduler gets the parent's ``sys.path``).

- ``late`` / ``early``: on the text model's output (``model``, the final norm's [N, H] rows, requests
  one after another): each row becomes the row before / after it in the same request;
- ``prefix_zero``: the rows at positions below ``PREFIX_K`` are zeros (a skipped prefix);
- ``aux_as_last``: the output is the last aux layer's residual stream, as the capture's layer hooks
  parked it (SGLang without the aux flag: 0.5.17);
- ``half_sum``: the last decoder layer's ``o_proj`` and ``down_proj`` return one of two TP ranks'
  shares (the row-parallel matmul over the first half of its inputs, not all-reduced).

``aux_off_by_one`` has no SGLang switch: the aux-layer check at the start of a capture
(``check_aux_layers``) catches it on every engine (tests/test_capture_audit_faults.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

PREFIX_K = 16  # as tests/audit_faults.py
FAULTS = ("late", "early", "prefix_zero", "aux_as_last", "half_sum")
_SELF = "sglang_audit_faults"


def request_starts(positions: torch.Tensor) -> torch.Tensor:
    """bool [N]: rows that begin a request's extend (its position does not follow the row before's)."""
    start = torch.ones_like(positions, dtype=torch.bool)
    start[1:] = positions[1:] != positions[:-1] + 1
    return start


def shift_rows(hidden: torch.Tensor, positions: torch.Tensor, fault: str) -> torch.Tensor:
    """``late``: row t holds row t - 1 of its request (a request's first row keeps its own); ``early``:
    row t holds row t + 1 (a request's last row keeps its own)."""
    start = request_starts(positions)
    out = hidden.clone()
    if fault == "late":
        keep = start[1:]
        out[1:] = torch.where(keep[:, None], hidden[1:], hidden[:-1])
    else:
        end = torch.zeros_like(start)
        end[:-1] = start[1:]
        end[-1] = True
        out[:-1] = torch.where(end[:-1, None], hidden[:-1], hidden[1:])
    return out


def _rows_of(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _with_rows(output: Any, rows: torch.Tensor) -> Any:
    return (rows, *output[1:]) if isinstance(output, tuple) else rows


def model_fault_factory(config: dict[str, Any]) -> Callable:
    """The hook on the text model (``model``): forward(input_ids, positions, forward_batch, ...) -> the
    final norm's rows [N, H] (or (rows, aux states) where SGLang hands the aux states over itself).
    config = {"fault": one of late, early, prefix_zero, aux_as_last; "dir": the capture dir (aux_as_last);
    "last_slot": the capture's last aux slot (aux_as_last)}."""
    fault = config["fault"]

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        rows, positions = _rows_of(output), args[1]
        if rows.shape[0] != positions.shape[0]:  # not a forward of rows we know (a padded CUDA-graph decode)
            return None
        if fault in ("late", "early"):
            return _with_rows(output, shift_rows(rows, positions, fault))
        if fault == "prefix_zero":
            return _with_rows(output, torch.where((positions < PREFIX_K)[:, None], torch.zeros_like(rows), rows))
        if fault == "aux_as_last":
            from eagle3_ray.engines import sglang_hooks

            parked = sglang_hooks._LAYER_ROWS.get(str(config["dir"]), {}).get(int(config["last_slot"]))
            if parked is None:
                raise RuntimeError("aux_as_last: no aux rows parked by the capture's layer hooks in this forward")
            return _with_rows(output, parked.to(rows.dtype))
        raise ValueError(f"unknown fault {fault!r}")

    return hook


def half_share_factory(config: dict[str, Any]) -> Callable:
    """The hook on a row-parallel linear (``o_proj``, ``down_proj``), forward(x) -> (out, bias): the output
    over the first half of its inputs, one of two ranks' shares without the all-reduce."""

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        x = args[0]
        k = x.shape[-1] // 2
        share = torch.nn.functional.linear(x[..., :k], module.weight[:, :k])
        return _with_rows(output, share)

    return hook


def fault_specs(fault: str, forward_hooks: list[dict], model_path: str, last_layer_path: str) -> list[dict]:
    """The hook specs that inject ``fault``, to go before the capture's ``forward_hooks`` (which name the
    capture dir and aux slots); ``model_path``: the text model's module (``model``), ``last_layer_path``:
    the last decoder layer's (``model.layers.<L-1>``)."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
    if fault == "half_sum":
        return [{"name": "audit_fault_half_sum", "hook_factory": f"{_SELF}:half_share_factory", "config": {},
                 "target_modules": [f"{last_layer_path}.self_attn.o_proj", f"{last_layer_path}.mlp.down_proj"]}]
    capture = next(s for s in forward_hooks if s.get("hook_factory", "").endswith(":capture_hook_factory"))
    config = {"fault": fault, "dir": capture["config"]["dir"],
              "last_slot": int(capture["config"].get("layer_slots", 0)) - 1}
    if fault == "aux_as_last" and config["last_slot"] < 0:
        raise ValueError("aux_as_last needs the layer-hook capture (SGLang without the aux flag: 0.5.17)")
    return [{"name": f"audit_fault_{fault}", "hook_factory": f"{_SELF}:model_fault_factory",
             "target_modules": [model_path], "config": config}]


def faulty_factory(fault: str, paths: Any, num_layers: int, factory: Callable[..., Any]) -> Callable[..., Any]:
    """An ``engine_factory`` for ``SGLangEngine``: ``factory`` (``sglang.Engine``) with ``fault``'s hooks
    ahead of the capture's; ``paths``: the target's ``engines.sglang_modules.ModulePaths``."""
    model_path = paths.decoder_layer(0).rsplit(".layers.", 1)[0]
    last_layer_path = paths.decoder_layer(num_layers - 1)

    def build(**kwargs: Any) -> Any:
        hooks = list(kwargs.get("forward_hooks") or [])
        kwargs["forward_hooks"] = [*fault_specs(fault, hooks, model_path, last_layer_path), *hooks]
        return factory(**kwargs)

    return build
