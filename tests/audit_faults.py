"""Fault switches for the capture audit (issue 61): each breaks a real HF engine's capture the way a
bug in a capture path would, inside the engine, so the audit's figures (computed by the engine from
the states it captured) see the fault exactly as a user's run would. Test and benchmark support only
(tests/test_capture_audit_faults.py, benchmarks/capture_audit.py); the library has no fault switch.

Each switch is a context manager over an ``HFEngine`` instance (``engines/hf.py``):

- ``late`` / ``early``: every row holds the state of the position before / after it (one off);
- ``aux_as_last``: ``last_hidden`` is the last aux layer's residual stream (the aux/last mapping);
- ``half_sum``: the last decoder layer's attention and MLP outputs are one of two tensor-parallel
  ranks' shares (the row-parallel ``o_proj`` / ``down_proj`` over half the inputs, not all-reduced);
- ``prefix_zero``: the first ``k`` rows were never written (zeros: a skipped prefix, radix cache);
- ``aux_off_by_one``: the aux states are ``hidden_states[k + 1]`` (the id convention off by one).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

PREFIX_K = 16  # rows of the skipped prefix


@contextmanager
def _states(engine, fault: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Route the engine's ``forward_states`` (aux [B, T, 3H], last [B, T, H]) through ``fault``."""
    real = engine.forward_states
    engine.forward_states = lambda ids, mask: fault(*real(ids, mask))
    try:
        yield
    finally:
        del engine.forward_states


def late(engine):
    return _states(engine, lambda aux, last: (aux, torch.cat([last[:, :1], last[:, :-1]], dim=1)))


def early(engine):
    return _states(engine, lambda aux, last: (aux, torch.cat([last[:, 1:], last[:, -1:]], dim=1)))


def aux_as_last(engine):
    return _states(engine, lambda aux, last: (aux, aux[..., -last.shape[-1]:]))


def prefix_zero(engine, k: int = PREFIX_K):
    def fault(aux, last):
        aux, last = aux.clone(), last.clone()
        aux[:, :k] = 0
        last[:, :k] = 0
        return aux, last

    return _states(engine, fault)


@contextmanager
def half_sum(engine) -> Iterator[None]:
    layer = engine.target.model.model.layers[-1]

    def rank0_share(module, args, out):  # a row-parallel linear over rank 0's half of its inputs
        x = args[0]
        k = x.shape[-1] // 2
        return torch.nn.functional.linear(x[..., :k], module.weight[:, :k])

    handles = [m.register_forward_hook(rank0_share) for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def aux_off_by_one(engine) -> Iterator[None]:
    from eagle3_ray.engines.hidden_states import HiddenStateSelection

    real = engine._select
    engine._select = HiddenStateSelection(engine.target.model.model, [k + 1 for k in engine.info.aux_layers])
    try:
        yield
    finally:
        engine._select = real


FAULTS = {"late": late, "early": early, "aux_as_last": aux_as_last, "half_sum": half_sum,
          "prefix_zero": prefix_zero, "aux_off_by_one": aux_off_by_one}
