"""The context-parallel exactness harness: `cp_exactness` runs the training step (`TrainStep`) over a
group of gloo ranks (spawned processes) and one process over the same packs, and reports the largest
loss, gradient and held-out metric differences. Used by tests/test_context_parallel.py (the check) and
benchmarks/cp_exact.py (the figure `cp_exact_cpu`); a benchmark may run it on other devices too
(``device="cuda"``, ``backend="nccl"``: one GPU a rank).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_ray.drafter.ttt import ttt_forward
from eagle3_ray.drafter.ttt_metrics import WALK_STEPS, held_out_metrics, held_out_sums, step_metrics
from eagle3_ray.train.context_parallel import setup, shard_batch
from eagle3_ray.train.step import StepConfig, TrainStep

# A tiny drafter (fp32 on CPU in the tests): hidden, heads, kv heads, head dim, intermediate, target vocab, draft vocab.
TINY_SHAPE = dict(hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, vocab=40, draft_vocab=24)
# Packs of sample lengths for a 2-way split (44, 44, 37 and 42 tokens: T = 22, 22, 19, 21): a sample boundary
# exactly at the split; one 3 tokens before it (within ttt_steps: rank 0's last steps read rank 1's tokens);
# one sample over the whole pack with padding after it; a sample ending 2 tokens after the split.
SPLIT_PACKS = ((10, 12, 9, 13), (19, 6, 19), (37,), (23, 19))


def tiny_drafter(shape: dict | None = None, seed: int = 0):
    """A seeded drafter of ``shape`` (`TINY_SHAPE`) with a random draft vocab map, and a target lm_head
    whose argmax mostly (not always) falls in the draft vocab."""
    s = {**TINY_SHAPE, **(shape or {})}
    torch.manual_seed(seed)
    d = Eagle3Drafter(DrafterConfig(
        hidden_size=s["hidden"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], intermediate_size=s["intermediate"], vocab_size=s["vocab"],
        draft_vocab_size=s["draft_vocab"], target_hidden_size=s["hidden"], aux_layers=[2, 3, 4], rms_norm_eps=1e-5))
    g = torch.Generator().manual_seed(seed)
    d.bind_embedding(torch.randn(s["vocab"], s["hidden"], generator=g))
    ids = torch.randperm(s["vocab"], generator=g)[: s["draft_vocab"]].sort().values
    t2d = torch.zeros(s["vocab"], dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(s["draft_vocab"]), t2d)
    lm_head = torch.randn(s["vocab"], s["hidden"], generator=g)
    lm_head[~t2d] *= 0.5
    return d, lm_head


def random_pack(lengths: Sequence[int], shape: dict | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """A packed [1, N] batch of random samples of ``lengths`` (random loss masks, about 80% on)."""
    s = {**TINY_SHAPE, **(shape or {})}
    g = torch.Generator().manual_seed(seed)
    n = int(sum(lengths))
    return {
        "input_ids": torch.randint(0, s["vocab"], (1, n), generator=g),
        "aux_hidden": torch.randn(1, n, 3 * s["hidden"], generator=g),
        "last_hidden": torch.randn(1, n, s["hidden"], generator=g),
        "loss_mask": (torch.rand(1, n, generator=g) > 0.2).long(),
        "position_ids": torch.cat([torch.arange(m) for m in lengths])[None],
        "seq_ids": torch.cat([torch.full((m,), j) for j, m in enumerate(lengths)])[None],
    }


# The option sets `cp_exactness` runs by default: each attention path, alone and with the long-sample options.
CHECK_CASES = (
    {"attention": "sdpa"},
    {"attention": "varlen"},
    {"attention": "sdpa", "loss_chunk_tokens": 5, "recompute_steps": True},
    {"attention": "varlen", "loss_chunk_tokens": 7, "recompute_steps": True},
)


def _case_name(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(case.items()))


class _AveragingEngine:
    """DeepSpeed's gradient handling in miniature (grad_accum 1): ``backward``, then ``step`` averages every
    gradient over the whole world (the data-parallel all-reduce DeepSpeed runs with no model-parallel unit)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        world = dist.get_world_size()
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world

    def get_lr(self) -> list[float]:
        return [0.0]


def _step_config(case: dict, ttt_steps: int) -> StepConfig:
    return StepConfig(ttt_steps=ttt_steps, attention=case.get("attention", "sdpa"),
                      loss_kernel=case.get("kernel", "torch"), loss_chunk_tokens=case.get("loss_chunk_tokens", 0),
                      recompute_steps=case.get("recompute_steps", False))


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().cpu().clone() for n, p in module.named_parameters() if p.grad is not None}


def _check_worker(rank: int, world: int, init: str, path: str, spec: dict) -> None:
    """One rank of `cp_exactness`: every case on its group's pack, through `TrainStep` (P x the rank's loss
    backpropagated) and `_AveragingEngine`; rank 0 saves the results."""
    torch.set_num_threads(1)
    device = torch.device(spec["device"] if spec["device"] == "cpu" else f"cuda:{rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(spec["backend"], init_method=init, rank=rank, world_size=world)
    try:
        cp = setup(spec["context_parallel"])
        results = {}
        for case in spec["cases"]:
            for j, group_packs in enumerate(spec["packs"]):
                drafter, lm_head = tiny_drafter(spec["shape"], spec["seed"])
                drafter.to(device=device, dtype=spec["dtype"])
                step = TrainStep(_AveragingEngine(drafter), lm_head.to(device, spec["dtype"]),
                                 _step_config(case, spec["ttt_steps"]), cp=cp)
                pack = {k: v.to(device) for k, v in group_packs[cp.dp_rank].items()}
                if pack["aux_hidden"].is_floating_point():
                    pack["aux_hidden"] = pack["aux_hidden"].to(spec["dtype"])
                    pack["last_hidden"] = pack["last_hidden"].to(spec["dtype"])
                shard = shard_batch(pack, cp.size, cp.rank, spec["ttt_steps"])
                held = step.held_out_sums([(shard, shard["cp_shard"].tokens)])  # evaluation: no gradient
                dist.all_reduce(held)  # every group's pack, as the training loop's evaluate sums them
                out = step(shard)
                part = out.loss.detach().float().reshape(1)
                dist.all_reduce(part, group=cp.group)  # the group's loss: its ranks' parts
                m = torch.tensor([part.item(), step_metrics(out.stats.tolist(), out.loss_decay)["loss"]],
                                 dtype=torch.float64)
                dist.all_reduce(m)
                stats = out.stats.detach().float().cpu().clone()
                dist.all_reduce(stats)
                results[(_case_name(case), j)] = {"loss_sum": m[0].item() / world, "loss": m[1].item() / world,
                                                  "stats": stats / world, "grads": _grads(drafter), "held": held}
        if rank == 0:
            torch.save(results, path)
    finally:
        dist.destroy_process_group()


def cp_exactness(context_parallel: int = 2, data_parallel: int = 1, packs: Sequence[Sequence[int]] = SPLIT_PACKS,
                 cases: Sequence[dict] = CHECK_CASES, ttt_steps: int = 4, shape: dict | None = None, seed: int = 0,
                 device: str = "cpu", backend: str = "gloo", dtype: torch.dtype = torch.float32) -> dict:
    """The context-parallel training step against one process, loss and every parameter gradient.

    ``context_parallel`` x ``data_parallel`` processes (torch.multiprocessing, ``backend``; on CUDA one GPU
    each) run `TrainStep` with `ContextParallel` groups on ``packs`` (sample lengths; group g of pack
    set j trains on pack j + g, so that the groups differ), gradients averaged over the world as DeepSpeed
    does; this process runs the same packs whole through `ttt_forward` (the mean over the groups' packs).
    Returns, per case (``"attention=sdpa"``, ...; ``cases``: `TrainStep` options) and over all packs, the
    largest absolute differences: ``loss`` (the group's metric), ``loss_sum`` (the sum of the ranks' losses,
    what is backpropagated), ``stats`` (every per-step figure), ``grad`` (every parameter's gradient entry),
    ``grad_rel`` (``grad`` over the largest gradient entry), ``held_out`` (every held-out metric of the
    groups' packs, `TrainStep.held_out_sums` summed over the ranks, the walked chain's tau included),
    ``walk`` (the walked chain's tokens and cycles: integers, so exactly 0), and under ``"max"`` the largest
    of each.
    """
    import torch.multiprocessing as mp

    world = context_parallel * data_parallel
    pack_sets = [[random_pack(packs[(j + g) % len(packs)], shape, seed + j + g) for g in range(data_parallel)]
                 for j in range(len(packs))]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        spec = dict(context_parallel=context_parallel, cases=list(cases), packs=pack_sets, ttt_steps=ttt_steps,
                    shape=shape, seed=seed, device=device, backend=backend, dtype=dtype)
        mp.spawn(_check_worker, args=(world, f"file://{os.path.join(tmp, 'store')}", out, spec), nprocs=world)
        got = torch.load(out, weights_only=True)
    report: dict[str, Any] = {}
    for case in cases:
        name = _case_name(case)
        worst = dict(loss=0.0, loss_sum=0.0, stats=0.0, grad=0.0, grad_rel=0.0, held_out=0.0, walk=0.0)
        for j, group_packs in enumerate(pack_sets):
            loss, stats, grads = 0.0, 0.0, {}
            held = torch.zeros_like(got[(_case_name(case), j)]["held"])
            for pack in group_packs:
                drafter, lm_head = tiny_drafter(shape, seed)
                drafter.to(dtype=dtype)
                c = _step_config(case, ttt_steps)
                pack = {k: v.to(dtype) if v.is_floating_point() else v for k, v in pack.items()}

                def forward(b, walk_steps=0, drafter=drafter, lm_head=lm_head, c=c):
                    return ttt_forward(drafter, b, lm_head.to(dtype), c.ttt_steps, c.loss_decay, c.attention,
                                       loss_kernel=c.loss_kernel, loss_chunk_tokens=c.loss_chunk_tokens,
                                       recompute_steps=c.recompute_steps, walk_steps=walk_steps)

                held += held_out_sums(drafter, [(pack, int((pack["seq_ids"] >= 0).sum()))],
                                      lambda b, f=forward: f(b, walk_steps=min(WALK_STEPS, ttt_steps)))
                ref = forward(pack)
                ref.loss.backward()
                loss += ref.loss.item() / data_parallel
                stats = stats + ref.stats.float() / data_parallel
                for n, gr in _grads(drafter).items():
                    grads[n] = grads.get(n, 0) + gr / data_parallel
            r = got[(name, j)]
            if r["grads"].keys() != grads.keys():
                raise AssertionError(f"{name}: gradients of {sorted(r['grads'])} against {sorted(grads)}")
            largest = max(float(g.abs().max()) for g in grads.values())
            grad = max(float((r["grads"][n] - g).abs().max()) for n, g in grads.items())
            if float(held[-1]) == 0:
                raise AssertionError(f"{name}: the packs of set {j} give no walked chain to compare")
            mine, ref_m = held_out_metrics(r["held"]), held_out_metrics(held)
            if mine.keys() != ref_m.keys():
                raise AssertionError(f"{name}: held-out metrics {sorted(mine)} against {sorted(ref_m)}")
            for k, v in (("loss", abs(r["loss"] - loss)), ("loss_sum", abs(r["loss_sum"] - loss)),
                         ("stats", float((r["stats"] - stats).abs().max())), ("grad", grad),
                         ("grad_rel", grad / max(largest, 1e-30)),
                         ("held_out", max(abs(mine[k] - ref_m[k]) for k in ref_m)),
                         ("walk", float((r["held"][-2:] - held[-2:]).abs().max()))):
                worst[k] = max(worst[k], v)
        report[name] = worst
    report["max"] = {k: max(r[k] for r in report.values())
                     for k in ("loss", "loss_sum", "stats", "grad", "grad_rel", "held_out", "walk")}
    return report
