"""Context parallelism (train.context_parallel; train/context_parallel.py): one pack split over a group of
workers gives the one-worker loss and gradients.

Exactness (real torch.distributed, gloo, spawned processes, a tiny fp32 drafter; tests/cp_exactness.py): on packs
with a sample boundary exactly at the split, one ttt_steps before it, one after it, and one sample over the
whole pack, the group's loss, per-step stats and every parameter gradient (after DeepSpeed-style averaging
over the world) equal one process's, for sdpa and varlen, each alone and with the long-sample options; with 4 ranks
as 2 groups of 2 (data parallel: the mean over the groups' packs) and as one group of 4 (a halo over two
ranks, a sample over all four). Largest differences seen (2026-12-06, this machine): loss 1.6e-6 (of ~9),
gradients 8.9e-8 absolute, 2.5e-7 of the largest gradient entry. Each of these checks was seen to fail
with the halo left out, the earlier ranks' keys left out, the key gather's backward not summed, or the
loss divided by the rank's own count (gradients off by 28% to 149% of the largest entry).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eagle3_ray.train.context_parallel import (
    ContextParallelError, CPShard, check_config, cp_attention_mask, shard_batch, shard_span,
)
from tests.cp_exactness import cp_exactness, random_pack

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = {"loss": 1e-5, "loss_sum": 1e-5, "stats": 1e-5, "grad": 1e-6, "grad_rel": 1e-5,  # fp32 rounding (losses ~9)
       "held_out": 1e-5, "walk": 0.0}  # held-out metrics the same; the walked chain's counts exactly


def _assert_exact(report: dict) -> None:
    print(json.dumps(report, indent=1))  # the measured differences, for the record (pytest -s)
    for case, diffs in report.items():
        for k, tol in TOL.items():
            assert diffs[k] <= tol, (case, k, diffs)


def test_two_ranks_give_the_one_process_loss_and_gradients():
    """2 gloo ranks, one group: 4 packs (a split at a sample boundary, 3 tokens after one, inside a sample
    with padding after it, 2 tokens before a sample's end), ttt_steps 4; sdpa and varlen, each alone and
    with loss_chunk_tokens and recompute_steps."""
    _assert_exact(cp_exactness(context_parallel=2))


def test_four_ranks_as_two_groups_and_as_one():
    """2 groups of 2: each group's pack differs, the gradient is the mean over the groups' packs (as
    grad_accum 2 on one worker), so the P x loss scaling under world-averaging is checked; 1 group of 4:
    T = 3 < ttt_steps (the halo spans two ranks) and a sample over all four ranks."""
    cases = [{"attention": "sdpa"}, {"attention": "varlen"}]
    _assert_exact(cp_exactness(context_parallel=2, data_parallel=2, cases=cases, packs=[(10, 12, 9, 13), (37,)]))
    _assert_exact(cp_exactness(context_parallel=4, cases=cases, packs=[(3, 30, 4), (5, 6)]))


# ------------------------------------------------------------------ splitting


def test_shards_carry_their_tokens_a_halo_and_where_they_sit():
    pack = random_pack((19, 6, 19))  # 44 tokens, T = 22: sample 1 spans the split (19..24)
    halo = 4
    s0, s1 = (shard_batch(pack, 2, r, halo) for r in (0, 1))
    assert s0["cp_shard"] == CPShard(local=22, offset=0, key_shift=0, tokens=22)
    assert s1["cp_shard"] == CPShard(local=22, offset=22, key_shift=3, tokens=22)  # sample 1 began at 19
    for k, v in pack.items():
        assert torch.equal(s0[k], v[:, :26]), k  # its own 22 tokens and the next 4 (the halo)
        assert torch.equal(s1[k][:, :22], v[:, 22:]), k
    assert s1["seq_ids"][0, 22:].tolist() == [-1] * 4 and not s1["loss_mask"][0, 22:].any()  # past the end
    last = shard_batch(random_pack((37,)), 2, 1, halo)["cp_shard"]  # 37 tokens: T = 19, one padding token
    assert last == CPShard(local=19, offset=19, key_shift=19, tokens=18)


def test_shard_span_reads_only_the_samples_a_shard_overlaps():
    span = shard_span([10, 12, 9, 13], 2, 1, 4)  # T = 22: rank 1 owns 22..43, sample 2 starts at 22
    assert (span.first, span.stop, span.base, span.shard.key_shift) == (2, 4, 22, 0)
    span = shard_span([10, 12, 9, 13], 2, 0, 4)  # rank 0 reads into sample 2 for its halo
    assert (span.first, span.stop, span.base) == (0, 3, 0)
    span = shard_span([5, 6], 4, 3, 4)  # T = 3: rank 3 owns 9..11, of which 9 and 10 are sample 1's
    assert (span.first, span.stop, span.base) == (1, 2, 5) and span.shard == CPShard(3, 9, 4, 2)
    assert shard_span([2], 4, 3, 1).shard == CPShard(1, 3, 0, 0)  # a shard of padding only


def test_the_dense_mask_puts_the_earlier_ranks_keys_first():
    seq = torch.tensor([[4, 4, 5, 5]])  # sample 4 began 2 tokens before this shard
    m = cp_attention_mask(seq, key_shift=2, step=1)[0, 0].int()
    assert m.tolist() == [
        # earlier  local prefix  step-1 diagonal
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1, 0, 0, 0, 1],
    ]


def test_varlen_segments_with_earlier_keys_and_their_gradient():
    """`Segments.of(key_shift=d)`: the first segment's keys start d earlier (flash attention's bottom-right
    causal alignment), the reference mask is the same; the hand-written backward is the gradient (float64)."""
    from eagle3_ray.drafter.ttt_attention import Segments, TTTCache, ttt_attention

    seq = torch.tensor([[7, 7, 7, 8, 8, -1]])
    s = Segments.of(seq, key_shift=3)
    assert s.cu_seqlens.tolist() == [0, 3, 5, 6] and s.cu_k.tolist() == [0, 6, 8, 9]
    assert (s.max_len, s.max_k) == (3, 6)
    m = s.mask()
    assert m.shape == (6, 9) and m[0, :4].all() and not m[0, 4:].any() and m[2, :6].all()
    assert not m[3, :6].any() and m[3, 6] and m[4, 6:8].all() and m[5].tolist() == [False] * 8 + [True]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    k0, v0 = (torch.randn(1, 2, 9, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    k1, v1 = (torch.randn(1, 2, 6, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def f(q, k0, v0, k1, v1):
        cache = TTTCache()
        cache.append(k0, v0)
        cache.append(k1, v1)
        return ttt_attention(q, cache, s, fused=False)

    assert torch.autograd.gradcheck(f, (q, k0, v0, k1, v1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: flash attention's varlen kernel")
def test_flash_varlen_shards_with_earlier_keys_give_the_whole_packs_rows():
    """CUDA, bf16, flash attention's varlen kernel: each of 4 shards of a pack (3 samples, one over three
    shards, padding at the end) attends over the keys its queries see, the earlier shards' ones of its
    first sample included (`Segments.key_shift`: causal attention aligned at the segment's end), and gives
    the whole pack's output rows and gradients (the keys' summed over the shards), as far as bf16 goes."""
    from eagle3_ray.drafter.ttt_attention import Segments, TTTCache, ttt_attention

    dev, dtype, size = torch.device("cuda"), torch.bfloat16, 4
    lengths, h, kv, d = (150, 700, 130), 8, 2, 64
    n = sum(lengths) + 44  # 1024 = 4 x 256 tokens, the last 44 padding
    # on the GPU, as the training loop's batches are (Segments.of puts cu_seqlens on the ids' device)
    seq = torch.cat([torch.full((m,), j) for j, m in enumerate(lengths)] + [torch.full((44,), -1)])[None].to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, h, n, d, generator=g, device=dev, dtype=dtype)
    k0, v0, k1, v1 = (torch.randn(1, kv, n, d, generator=g, device=dev, dtype=dtype) for _ in range(4))
    grad = torch.randn(1, h, n, d, generator=g, device=dev, dtype=dtype)

    def run(q, k0, v0, k1, v1, segments, grad_out):
        leaves = [x.detach().requires_grad_() for x in (q, k0, v0, k1, v1)]
        cache = TTTCache()
        cache.append(*leaves[1:3])
        cache.append(*leaves[3:])
        out = ttt_attention(leaves[0], cache, segments, fused=True)
        out.backward(grad_out)
        return out.float(), [x.grad.float() for x in leaves]

    whole, whole_grads = run(q, k0, v0, k1, v1, Segments.of(seq), grad)
    got_dk0, got_dv0 = torch.zeros_like(whole_grads[1]), torch.zeros_like(whole_grads[2])
    t = n // size
    for r in range(size):
        shard = shard_batch({"seq_ids": seq.cpu()}, size, r, 0)["cp_shard"]
        lo, hi, ks = r * t, (r + 1) * t, r * t - shard.key_shift
        rows = (slice(None), slice(None), slice(lo, hi))
        out, (dq, dk0, dv0, dk1, dv1) = run(q[rows], k0[..., ks:hi, :], v0[..., ks:hi, :], k1[rows], v1[rows],
                                            Segments.of(seq[:, lo:hi], key_shift=shard.key_shift), grad[rows])
        got_dk0[..., ks:hi, :] += dk0
        got_dv0[..., ks:hi, :] += dv0
        for name, a, b in (("out", out, whole[rows]), ("dq", dq, whole_grads[0][rows]),
                           ("dk1", dk1, whole_grads[3][rows]), ("dv1", dv1, whole_grads[4][rows])):
            assert (a - b).abs().max() <= 2e-2 * b.abs().max(), (r, name, float((a - b).abs().max()))
    for name, a, b in (("dk0", got_dk0, whole_grads[1]), ("dv0", got_dv0, whole_grads[2])):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max(), (name, float((a - b).abs().max()))


# ------------------------------------------------------------------ settings


def test_impossible_settings_are_refused_naming_what_to_change():
    from eagle3_ray.config import TrainConfig, load_config

    with pytest.raises(ContextParallelError, match=r"num_workers=3 is not a multiple of train.context_parallel=2"):
        load_config("configs/ci-tiny.yaml", ["train.context_parallel=2", "train.num_workers=3"])
    with pytest.raises(ContextParallelError, match=r"train.mode=offline"):
        load_config("configs/ci-tiny.yaml", ["train.context_parallel=2", "train.num_workers=2", "train.mode=online"])
    with pytest.raises(ContextParallelError, match=r"train.attention=flex .* use train.attention=varlen"):
        TrainConfig(context_parallel=2, num_workers=2, attention="flex")
    with pytest.raises(ContextParallelError, match=r"train.compile=false"):
        check_config(2, 2, compile=True)
    with pytest.raises(ValueError):
        TrainConfig(context_parallel=0)
    assert load_config("configs/ci-tiny.yaml", ["train.context_parallel=2", "train.num_workers=4"]).train.context_parallel == 2

    from eagle3_ray.train.step import resolve_attention

    assert resolve_attention("auto", "cuda", 128, (9, 0), context_parallel=2) == "varlen"
    assert resolve_attention("auto", "cpu", 128, None, context_parallel=2) == "sdpa"
    with pytest.raises(ContextParallelError, match="flex"):
        resolve_attention("flex", "cuda", 128, (9, 0), context_parallel=2)


def test_off_leaves_the_stage_hashes_and_on_redoes_training():
    """context_parallel=1 hashes as before the option (tests/test_run_pipeline.py checks the formula);
    another value changes the packs, so training and what follows are redone, not the stages before."""
    from eagle3_ray.config import load_config
    from eagle3_ray.pipeline import _stage_hash

    cfg = load_config("configs/ci-tiny.yaml")
    on = load_config("configs/ci-tiny.yaml", ["train.context_parallel=2", "train.num_workers=2"])
    two = load_config("configs/ci-tiny.yaml", ["train.num_workers=2"])
    for stage in ("extract", "vocab"):
        assert _stage_hash(on, stage, "d") == _stage_hash(cfg, stage, "d")
    for stage in ("train", "export", "bench"):
        assert _stage_hash(on, stage, "d") != _stage_hash(two, stage, "d")
    assert _stage_hash(load_config("configs/ci-tiny.yaml", ["train.context_parallel=1"]), "train", "d") == \
        _stage_hash(cfg, "train", "d")


# ------------------------------------------------------------------ the pack loader and the worker's batches


def _tiny_store(root, compact: str = "none"):
    from eagle3_ray.features import FeatureStoreWriter, open_store
    from eagle3_ray.features.store import StoreMeta
    from tests.test_feature_store import META, make_record

    meta = StoreMeta.from_dict({**META.to_dict(), "compact": compact})
    with FeatureStoreWriter(root, meta, "w0") as w:
        for i, n in enumerate((19, 6, 19, 37, 5)):
            w.add(make_record(f"s{i}", n, seed=i))
    return open_store(root)


@pytest.mark.parametrize("compact", ["none", "fp8"])
def test_the_pack_loader_emits_each_ranks_shard_of_the_pack(tmp_path, compact):
    """LoadPackUDF with cp=(2, r, halo) gives rank r's shard of the pack the plain loader packs, read from
    the samples the shard overlaps only; the worker's batch from it (Trainer._convert) carries its
    CPShard, varlen segments with the earlier keys, and the sample tokens it owns."""
    from eagle3_ray.config import TrainConfig
    from eagle3_ray.train.data import CP_KEYS, LoadPackUDF, row_to_batch
    from eagle3_ray.train.loop import Trainer

    _tiny_store(tmp_path / "store", compact)
    samples = [0, 1, 2]  # 44 tokens: rank 1 starts 3 tokens into sample 1
    rows = {"key": np.asarray(["0:0"]), "samples": [np.asarray(samples)]}
    whole = LoadPackUDF(str(tmp_path / "store"))(rows)
    whole = row_to_batch({k: v[0] for k, v in whole.items()}, "cpu", torch.float32)
    trainer = Trainer.__new__(Trainer)  # only what _convert reads
    trainer.t, trainer.device, trainer.hidden_dtype = TrainConfig(), torch.device("cpu"), torch.float32
    got_tokens = 0
    for rank in range(2):
        udf = LoadPackUDF(str(tmp_path / "store"), cp=(2, rank, 3))
        read = []
        udf._read = lambda i, read=read, real=udf._read: read.append(i) or real(i)
        out = udf(rows)
        assert read == ([0, 1] if rank == 0 else [1, 2])
        row = {k: v[0] for k, v in out.items()}
        want = shard_batch(whole, 2, rank, 3)
        for attention in ("sdpa", "varlen"):
            trainer.attention = attention
            batch, tokens = trainer._convert(row)
            assert batch["cp_shard"] == want["cp_shard"] == CPShard(*(int(row[k]) for k in CP_KEYS))
            for k in ("input_ids", "loss_mask", "aux_hidden", "last_hidden", "position_ids", "seq_ids"):
                assert torch.equal(batch[k], want[k]), (rank, k)
            if attention == "varlen":
                assert batch["segments"].key_shift == want["cp_shard"].key_shift == (3 if rank else 0)
        got_tokens += tokens
    assert got_tokens == 44


def test_a_group_on_different_packs_is_stopped():
    """The loop checks every step that the group's ranks hold the same pack (gloo, 2 processes)."""
    import torch.multiprocessing as mp

    mp.spawn(_pack_check_worker, args=(2, _init_file()), nprocs=2)


def _init_file() -> str:
    import tempfile

    return f"file://{tempfile.mkdtemp()}/store"


def _pack_check_worker(rank: int, world: int, init: str) -> None:
    import torch.distributed as dist

    from eagle3_ray.train.context_parallel import setup

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cp = setup(2)
    assert (cp.size, cp.rank, cp.dp_rank, cp.dp_size) == (2, rank, 0, 1)
    cp.check_same_pack("0:3")
    with pytest.raises(RuntimeError, match="out of order"):
        cp.check_same_pack(f"0:{rank}")
    dist.destroy_process_group()


# ------------------------------------------------------------------ a Ray Train run


def test_ray_train_workers_split_each_pack_and_step_on_the_one_worker_loss(ci_tiny_inputs, tmp_path):
    """ci-tiny on Ray Train with 2 gloo workers in one context-parallel group: each reads its own shards
    (train_<rank>), in the plan's order; the first step's loss, before any update, is the loss of the first
    pack (up to 2 x batch_tokens) on one process; the training tokens count every token of the packs once.
    Held-out evaluation splits each held-out pack over the group too: at lr 1e-12 (the weights stay the
    initial ones) its metrics, the walked chain's tau included, are one process's on the whole packs."""
    from eagle3_ray.config import load_config
    from eagle3_ray.drafter.ttt import ttt_forward
    from eagle3_ray.drafter.ttt_metrics import WALK_STEPS, held_out_metrics, held_out_sums
    from eagle3_ray.train.data import LoadPackUDF, row_to_batch
    from eagle3_ray.train.loop import build_drafter
    from eagle3_ray.train.trainer import plan_training, run_training, train_job

    features, vocab = ci_tiny_inputs / "features", ci_tiny_inputs / "vocab"
    cfg = load_config("configs/ci-tiny.yaml", ["train.context_parallel=2", "train.num_workers=2", "train.max_steps=2",
                                               "train.log_every=1", "train.checkpoint_every=2", "train.val_share=0.5",
                                               "train.eval_every=2", "train.lr=1e-12"])
    out = tmp_path / "train"
    ckpt = run_training(cfg, features, vocab, out)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]

    train_plan, _ = plan_training(cfg, features, vocab, tmp_path / "plan")
    packs = train_plan.packs
    assert max(p.tokens for p in packs) > cfg.train.batch_tokens  # packs for the group: up to 2 x batch_tokens
    assert lines[-1]["train_tokens"] == packs[0].tokens + packs[1].tokens
    from eagle3_ray.train.checkpoint import consumed_packs

    assert consumed_packs(ckpt) == {packs[0].key, packs[1].key}  # both ranks on the plan's first two packs
    row = LoadPackUDF(str(features))({"key": np.asarray([packs[0].key]), "samples": [np.asarray(packs[0].samples)]})
    batch = row_to_batch({k: v[0] for k, v in row.items()}, "cpu", torch.float32)
    drafter, lm_head = build_drafter(train_job(cfg, train_plan, tmp_path, False, tmp_path / "s"), torch.device("cpu"))
    with torch.no_grad():
        want = ttt_forward(drafter, batch, lm_head, cfg.train.ttt_steps, cfg.train.loss_decay).metrics["loss"]
    assert lines[0]["loss"] == pytest.approx(want, rel=1e-5)

    assert max(p.tokens for p in train_plan.val_packs) > cfg.train.batch_tokens  # held-out packs for the group
    assert "val_loss" not in lines[0]
    pairs = []
    for p in train_plan.val_packs:
        row = LoadPackUDF(str(features))({"key": np.asarray([p.key]), "samples": [np.asarray(p.samples)]})
        pairs.append((row_to_batch({k: v[0] for k, v in row.items()}, "cpu", torch.float32), p.tokens))
    walk = min(WALK_STEPS, cfg.train.ttt_steps)
    held = held_out_metrics(held_out_sums(drafter, pairs, lambda b: ttt_forward(
        drafter, b, lm_head, cfg.train.ttt_steps, cfg.train.loss_decay, walk_steps=walk)))
    assert held["val_tokens"] == lines[-1]["val_tokens"] == sum(p.tokens for p in train_plan.val_packs)
    assert held["val_tau_walk3"] == lines[-1]["val_tau_walk3"]  # counts of whole cycles: exact
    for k in ("val_loss", "val_tau", "val_acc_0", "val_tau_chain3"):
        assert lines[-1][k] == pytest.approx(held[k], rel=1e-5), k
