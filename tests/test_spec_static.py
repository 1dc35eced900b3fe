"""StaticTarget (preallocated KV storage, CUDA graphs per verify width) and StaticProposer (static
drafter cache, graphed chain / tree / commit steps): the same greedy output and the same acceptance
as the DynamicCache path with the eager drafter, the same drafts as the eager Eagle3Proposer after
commits of every width, storage reuse across generations, graph safety of every graphed function
(no host sync), and the errors a user can cause. The graph capture itself needs CUDA and is
exercised by the bench stage on a GPU (bench.cuda_graphs); off CUDA the identical functions run
eagerly."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_ray.errors import ConfigError
from eagle3_ray.decode import (
    Eagle3Proposer,
    StaticProposer,
    StaticTarget,
    generate,
    prepare_drafter,
    target_generate,
    target_top2,
)
from eagle3_ray.decode.sampling import Sampling, make_sampling
from eagle3_ray.decode.static import DRAFT_HEADROOM, StaticRunner
from eagle3_ray.decode.tree import select_nodes


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_config):
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config).eval()
    layers = tiny_llama_config.num_hidden_layers
    cfg = DrafterConfig.from_target(tiny_llama_config, tiny_llama_config.vocab_size, [2, layers // 2, layers - 3])
    torch.manual_seed(1)
    drafter = prepare_drafter(Eagle3Drafter(cfg), target)
    return target, drafter


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (5 + 7 * i,), generator=g).tolist() for i in range(n)]


MODES = [("chain", {"num_steps": 3}), ("tree", {"topk": 3, "depth": 4, "total_tokens": 10})]


@pytest.mark.parametrize("draft_graphs", [True, False], ids=["static-drafter", "eager-drafter"])
def test_same_tokens_and_acceptance_as_the_dynamic_cache(tiny, draft_graphs):
    target, drafter = tiny
    static = StaticTarget(target, drafter.config.aux_layers, max_length=256, draft_graphs=draft_graphs)
    # Prompts of growing then shrinking length: the storage is reused and old content must stay hidden.
    prompts = _prompts(3, target.config.vocab_size)
    for prompt in prompts + prompts[::-1]:
        ref, _ = target_generate(target, prompt, 20, eos_token_id=[])
        assert target_generate(static, prompt, 20, eos_token_id=[])[0] == ref
        replay, top2 = target_top2(static, prompt, 20, eos_token_id=[])  # the audit's untimed replay
        assert replay == ref and len(top2) == 20 and all(c >= abs(a) and a >= b for a, b, c in top2)
        for mode, params in MODES:
            dyn, dyn_stats = generate(target, drafter, prompt, 20, mode=mode, eos_token_id=[], **params)
            out, stats = generate(static, drafter, prompt, 20, mode=mode, eos_token_id=[], **params)
            assert out == dyn == ref
            assert stats.accept_hist == dyn_stats.accept_hist  # same drafts, same verdicts
            # Greedy on the static drafter: the commit runs inside the next draft's graph, decided on the device.
            ahead = draft_graphs
            assert set(stats.parts) == {"prefill", "draft", "verify", "accept"} | (set() if ahead else {"commit"})
    assert static.captured == []  # no graphs off CUDA
    assert bool(static._proposers) == draft_graphs  # the static drafter was (not) used
    if draft_graphs:
        assert static.proposer(drafter).captured == []


def _primed_proposers(drafter, prompt: torch.Tensor, g: torch.Generator, max_length: int, graphs: bool,
                      monkeypatch) -> tuple[Eagle3Proposer, StaticProposer]:
    """The eager and the static proposer of ``drafter``, both given ``prompt`` with the same random aux
    states; the static one through the graph path (FakeGraph standing in for CUDA) when ``graphs``."""
    eager, static = Eagle3Proposer(drafter), StaticProposer(drafter, max_length=max_length)
    if graphs:
        _use_fake_graphs(monkeypatch)
        static.cuda_graphs = True
    with torch.inference_mode():
        aux = torch.randn(prompt.shape[0], drafter.config.target_hidden_size * len(drafter.config.aux_layers),
                          generator=g)
        for p in (eager, static):
            p.begin(prompt)
            p.extend(prompt, aux)
    return eager, static


@pytest.mark.parametrize("graphs", [False, True], ids=["eager-calls", "fake-graphs"])
def test_static_drafter_drafts_as_the_eager_one(tiny, graphs, monkeypatch):
    """Proposer level, fp32: after the prompt and after commits of every width (partial and full
    acceptance, padded to the mode's widest commit), the StaticProposer drafts exactly the eager
    Eagle3Proposer's chains (greedy and sampled) and trees, and keeps the same drafter state; run
    eagerly and through the graph path (FakeGraph standing in for the CUDA capture)."""
    target, drafter = tiny
    width = 3 * target.config.hidden_size
    g = torch.Generator().manual_seed(5)
    prompt = torch.tensor(_prompts(1, target.config.vocab_size, seed=7)[0])
    eager, static = _primed_proposers(drafter, prompt, g, 160, graphs, monkeypatch)
    with torch.inference_mode():
        commits = [1, 4, 2, 5, 3, 1, 4, 2, 5, 1]  # chain: up to K+1 = 4; tree: up to depth+1 = 5
        for step, m in enumerate(commits):
            if step % 3 == 0:
                a, b = eager.draft_chain(3, Sampling()), static.draft_chain(3, Sampling())
                assert a.ids == b.ids and b.q is None
            elif step % 3 == 1:
                a, b = eager.draft_tree(3, 4, 10), static.draft_tree(3, 4, 10)
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            else:
                a = eager.draft_chain(3, make_sampling(1.0, 0.9, step, prompt.device))
                b = static.draft_chain(3, make_sampling(1.0, 0.9, step, prompt.device))
                assert a.ids == b.ids
                torch.testing.assert_close(a.q, b.q)
            ids = torch.randint(3, target.config.vocab_size, (m,), generator=g)
            aux = torch.randn(m, width, generator=g)
            eager.extend(ids, aux)
            static.extend(ids, aux)
            assert static.committed == eager.committed
            if step % 2:  # a read of the state runs the commit alone; else it runs inside the next draft's graph
                torch.testing.assert_close(static.hidden, eager.hidden, rtol=1e-5, atol=1e-5)
    # Begin again on a shorter prompt: the storage is reused and the old keys must stay hidden.
    with torch.inference_mode():
        short = prompt[:4]
        aux = torch.randn(4, width, generator=g)
        for p in (eager, static):
            p.begin(short)
            p.extend(short, aux)
        assert eager.draft_tree(3, 4, 10).tokens.tolist() == static.draft_tree(3, 4, 10).tokens.tolist()
    # chain 3 and tree (3, 4) after the prompt, commits of 4 and 5 alone, and commits inside each draft's graph
    assert set(static.captured) == (set() if not graphs else {
        ("chain", 3), ("tree", 3, 4, 10), ("extend", 4), ("extend", 5), ("extend", 4, "chain", 3),
        ("extend", 4, "tree", 3, 4, 10), ("extend", 5, "chain", 3)})


@pytest.mark.parametrize("graphs", [False, True], ids=["eager-calls", "fake-graphs"])
def test_a_verdict_taken_on_the_device_commits_as_the_host_would(tiny, graphs, monkeypatch):
    """chain_after_verify / tree_after_verify (a greedy verify's commit, its pairs selected inside the
    next draft's graph from the accepted flags) draft and keep exactly the state of the eager
    Eagle3Proposer given the host's commit, for accepted paths of every length; and the proposer
    refuses other calls until settle()."""
    target, drafter = tiny
    width, k, (topk, depth, total) = 3 * target.config.hidden_size, 3, (3, 4, 10)
    g = torch.Generator().manual_seed(9)
    prompt = torch.tensor(_prompts(1, target.config.vocab_size, seed=3)[0])
    eager, static = _primed_proposers(drafter, prompt, g, 200, graphs, monkeypatch)
    with torch.inference_mode():
        draft = static.draft_chain(k, Sampling())
        assert draft.ids == eager.draft_chain(k, Sampling()).ids
        for step, n in enumerate([0, 3, 1, 2, 3, 0, 2, 1]):  # chain: accepted drafts; tree: path depth (capped)
            if step < 4:
                path = list(range(n + 1))
            else:  # a root-to-node path of the last tree, ending at a node of depth up to n
                parents = draft.parents.tolist()
                node = max((i for i, _ in enumerate(parents) if draft.depth[i + 1] <= n), default=None)
                path = [0]
                while node is not None and node >= 0:
                    path.insert(1, node + 1)
                    node = parents[node] if parents[node] >= 0 else None
            size = k + 1 if step < 4 else draft.tokens.shape[0] + 1
            best = torch.randint(3, target.config.vocab_size, (size,), generator=g)
            accepted = torch.zeros(size, dtype=torch.bool)
            accepted[path] = True
            aux = torch.randn(size, width, generator=g)
            if step < 3:
                draft = static.chain_after_verify(best, accepted, aux, k)
            else:
                draft = static.tree_after_verify(best, accepted, aux, topk, depth, total)
            with pytest.raises(RuntimeError, match="settle"):
                static.draft_chain(k, Sampling())
            static.settle(len(path))
            eager.extend(best[path], aux[path])
            if step < 3:
                assert draft.ids == eager.draft_chain(k, Sampling()).ids
            else:
                ref = eager.draft_tree(topk, depth, total)
                assert torch.equal(draft.tokens, ref.tokens) and torch.equal(draft.parents, ref.parents)
            assert static.committed == eager.committed
            torch.testing.assert_close(static.hidden, eager.hidden, rtol=1e-5, atol=1e-5)
    assert set(static.captured) == (set() if not graphs else {
        ("chain", 3), ("verified", 4, "chain", 3), ("verified", 4, "tree", 3, 4, 10), ("verified", 11, "tree", 3, 4, 10)})


def test_partial_acceptance_and_moved_paths_as_the_dynamic_cache(tiny_llama_config, monkeypatch):
    """Greedy decoding on the static drafter (the verdict taken on the device, the next draft queued
    before the host reads it) accepts exactly what the DynamicCache path with the eager drafter
    accepts when drafts are accepted in part: a 4-token target whose final norm is zeroed (its argmax
    is always token 0) and a random drafter that drafts token 0 some of the time. Tree paths that skip
    nodes move the target's keys on the device; the aux states read from the moved keys feed the drafter."""
    config = tiny_llama_config.__class__(**{**tiny_llama_config.to_dict(), "vocab_size": 4})
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.model.norm.weight.zero_()  # logits all 0: the target's greedy choice is token 0
    cfg = DrafterConfig.from_target(config, 4, [2, 4, 5])
    torch.manual_seed(4)
    drafter = prepare_drafter(Eagle3Drafter(cfg), target)
    static = StaticTarget(target, cfg.aux_layers, max_length=256)
    moved = []  # (host path, the device offsets the loop passed) of every path that skipped nodes
    keep_path = StaticRunner.keep_path

    def recording(self, past, path, on_device=None):
        if list(path) != list(range(len(path))):
            moved.append((list(path), on_device.tolist()))
        return keep_path(self, past, path, on_device)

    monkeypatch.setattr(StaticRunner, "keep_path", recording)
    g = torch.Generator().manual_seed(8)
    hists = {"chain": [0] * 4, "tree": [0] * 5}
    for _ in range(4):
        prompt = torch.randint(0, 4, (9,), generator=g).tolist()
        for mode, params in MODES:
            dyn, dyn_stats = generate(target, drafter, prompt, 40, mode=mode, eos_token_id=[], **params)
            out, stats = generate(static, drafter, prompt, 40, mode=mode, eos_token_id=[], **params)
            assert out == dyn == [0] * 40
            assert stats.accept_hist == dyn_stats.accept_hist and "commit" not in stats.parts
            hists[mode] = [a + b for a, b in zip(hists[mode], stats.accept_hist)]
    # Rejections, partial and full acceptance (here chain [79, 1, 0, 20], tree [0, 1, 52, 0, 0]).
    assert sum(h > 0 for h in hists["chain"]) >= 3 and sum(h > 0 for h in hists["tree"]) >= 2, hists
    assert moved and all(host == dev for host, dev in moved)  # paths that skipped nodes, moved by the device's offsets


@pytest.mark.parametrize("offsets_on_device", [False, True], ids=["host-path", "device-path"])
def test_tree_paths_move_in_the_storage(tiny, offsets_on_device):
    """A tree whose accepted path is not the first nodes: keys move down to consecutive slots (the
    path's offsets from the host, or on the device as the greedy loop passes them)."""
    target, drafter = tiny
    static = StaticTarget(target, drafter.config.aux_layers, max_length=128)
    prompt = _prompts(1, target.config.vocab_size, seed=3)[0]
    runner = static.runner(drafter.config.aux_layers)
    ids = torch.tensor(prompt)
    runner.forward(ids)
    past = runner.length
    # Root + 3 nodes; node 1 and node 3 are siblings under the root, node 2 is node 1's child.
    tree_ids = torch.tensor([5, 7, 9, 11])
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 2, 1])
    runner.forward(tree_ids, positions=past + depth, mask=visible)
    runner.keep_path(past, [0, 3], torch.tensor([0, 3]) if offsets_on_device else None)  # root, then node 3
    nxt = runner.forward(torch.tensor([13])).logits[-1]
    ref = target(torch.tensor([prompt + [5, 11, 13]])).logits[0, -1]
    torch.testing.assert_close(nxt, ref, rtol=1e-4, atol=1e-4)


class NoHostSync(TorchDispatchMode):
    """Fails on every op that reads a device value on the host (a sync, which a CUDA graph cannot hold),
    and on every tensor made from host data (``aten.lift_fresh``: ``torch.tensor(...)``, ``t[i] = 1.0``),
    which on CUDA is a host-to-device copy that a capture refuses."""

    SYNCS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero", "aten.equal",
             "aten.lift_fresh")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.SYNCS):
            raise AssertionError(f"host sync inside the graphed forward: {func}")
        return func(*args, **(kwargs or {}))


def test_the_graphed_functions_have_no_host_sync(tiny):
    target, drafter = tiny
    static = StaticTarget(target, drafter.config.aux_layers, max_length=64)
    w = 4
    buf = {"ids": torch.arange(w), "past": torch.tensor(10), "depth": torch.arange(w),
           "tree": torch.ones(w, w, dtype=torch.bool).tril()}
    with torch.inference_mode(), NoHostSync():
        logits, aux = static._run(**buf)
    assert logits.shape == (w, target.config.vocab_size) and aux.shape == (w, 3 * target.config.hidden_size)
    # The drafter's graphed steps: commit of a fixed width, greedy chain, tree expansion.
    proposer = static.proposer(drafter)
    hidden = torch.randn(1, 1, target.config.hidden_size)
    ten, two, fourteen = torch.tensor(10), torch.tensor(2), torch.tensor(14)  # the graphs' input buffers
    best, accepted = torch.tensor([5, 6, 9, 8]), torch.tensor([True, True, True, False])  # a verdict: 2 drafts kept
    with torch.inference_mode(), NoHostSync():
        out = proposer._extend(torch.arange(w), aux, ten, two)
        chain = proposer._chain(hidden, fourteen, 3)
        tokens, scores, parents = proposer._tree(hidden, fourteen, 3, 4)
        tree = select_nodes(tokens, scores, parents, 10)  # inside the tree's graph too, with its layout
        proposer._chain(out, ten + two + 1, 3)  # a commit and the next draft in one graph: past + last + 1
        verified, _ = proposer._verified(best, accepted, aux, ten, lambda h, p: (proposer._chain(h, p, 3),), 4)
    assert out.shape == (1, 1, target.config.hidden_size) and chain.shape == verified.shape == (3,)
    assert tokens.shape == scores.shape == parents.shape == (3 + 3 * 9,)
    assert tree.tokens.shape == (10,) and tree.visible.shape == (11, 11)
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():  # the check itself can fail
        int(torch.arange(3)[1] + 1)
    with pytest.raises(AssertionError, match="lift_fresh"), NoHostSync():  # a host value copied in
        torch.zeros(3)[torch.arange(2)] = 1.0


def test_smollm2_static_is_greedy(smollm2):
    target, tok = smollm2
    torch.manual_seed(1)
    layers = target.config.num_hidden_layers
    cfg = DrafterConfig.from_target(target.config, 2048, [2, layers // 2, layers - 3])
    drafter = prepare_drafter(Eagle3Drafter(cfg), target)
    static = StaticTarget(target, cfg.aux_layers, max_length=96)
    prompt = tok("The capital of France is")["input_ids"]
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    for mode, params in MODES:
        assert generate(static, drafter, prompt, 16, mode=mode, **params)[0] == ref


def test_user_errors(tiny, tiny_llama_config):
    target, drafter = tiny
    static = StaticTarget(target, drafter.config.aux_layers, max_length=32)
    with pytest.raises(ConfigError, match="max_length=32"):
        target_generate(static, list(range(3, 30)), 10, eos_token_id=[])
    with pytest.raises(ConfigError, match="aux_layers="):
        StaticTarget(target, [1], max_length=32).runner(drafter.config.aux_layers)
    first = static.runner()
    static.runner()
    with pytest.raises(RuntimeError, match="one generation at a time"):
        first.forward(torch.tensor([3, 4]))
    sliding = LlamaConfig(**{**tiny_llama_config.to_dict(), "layer_types": ["sliding_attention"] * 8,
                             "sliding_window": 16})
    with pytest.raises(ConfigError, match="full-attention"):
        StaticTarget(LlamaForCausalLM(sliding).eval(), max_length=32)
    assert isinstance(static.runner(), StaticRunner)


class FakeGraph:
    """Test double for a captured CUDA graph (capture needs CUDA): ``replay`` re-runs the function
    on the captured input buffers and writes into the captured output tensors in place, as a replay
    does; so the buffer plumbing around the graphs (inputs filled/copied, outputs cloned, storage
    slots restored after a capture) runs on the CPU."""

    def __init__(self, fn, buf):
        self.fn, self.buf = fn, buf
        self.out = fn(**buf)
        self.replays = 0

    def replay(self):
        self.replays += 1
        new = self.fn(**self.buf)
        for dst, src in zip(*(o if isinstance(o, tuple) else (o,) for o in (self.out, new))):
            dst.copy_(src)


def _use_fake_graphs(monkeypatch, module=None) -> list[FakeGraph]:
    """FakeGraph for every capture of ``module`` (the drafter's, static_draft, by default; the
    target's is eagle3_ray.decode.static); returns the graphs as they are captured."""
    import eagle3_ray.decode.static_draft as static_draft

    graphs: list[FakeGraph] = []

    def fake_capture(fn, buf, device):
        graphs.append(FakeGraph(fn, buf))
        return graphs[-1], graphs[-1].out

    monkeypatch.setattr(module or static_draft, "capture_graph", fake_capture)
    return graphs


def test_the_graph_plumbing_gives_the_eager_tokens(tiny, monkeypatch):
    graphs = _use_fake_graphs(monkeypatch)
    target, drafter = tiny
    static = StaticTarget(target, drafter.config.aux_layers, max_length=256)
    static.proposer(drafter).cuda_graphs = True  # the graph path, with FakeGraph standing in for CUDA
    for prompt in _prompts(2, target.config.vocab_size, seed=11):
        ref, _ = target_generate(target, prompt, 20, eos_token_id=[])
        for mode, params in MODES:
            dyn, dyn_stats = generate(target, drafter, prompt, 20, mode=mode, eos_token_id=[], **params)
            out, stats = generate(static, drafter, prompt, 20, mode=mode, eos_token_id=[], **params)
            assert out == dyn == ref and stats.accept_hist == dyn_stats.accept_hist
    keys = static.proposer(drafter).captured
    # After the prompt a draft alone; after a verify the commit and the next draft in one graph.
    # Greedy: the commit's pairs are selected inside that graph from the verify's verdict ("verified").
    assert set(keys) == {("chain", 3), ("verified", 4, "chain", 3), ("tree", 3, 4, 10), ("verified", 11, "tree", 3, 4, 10)}
    assert all(g.replays > 0 for g in graphs)


def test_drafter_attention_covers_the_context_not_the_capacity(tiny, monkeypatch):
    """The static drafter's steps attend over the smallest span holding their keys (the drafter's
    storage is the target's max_length + headroom), crossing spans mid-generation with the eager
    drafter's tokens; capture_spans then captures every span of every step met."""
    _use_fake_graphs(monkeypatch)
    target, drafter = tiny
    static = StaticTarget(target, drafter.config.aux_layers, max_length=600)
    proposer = static.proposer(drafter)
    proposer.cuda_graphs = True  # the graph path, with FakeGraph standing in for CUDA
    assert proposer.spans == [256, 512, 1024, 600 + DRAFT_HEADROOM]
    seen: list[int] = []
    drafter.midlayer.self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(args[3].shape[-1]) if isinstance(args[3], torch.Tensor) else None)
    prompt = torch.randint(3, target.config.vocab_size, (236,), generator=torch.Generator().manual_seed(2)).tolist()
    ref, _ = target_generate(target, prompt, 40, eos_token_id=[])
    for mode, params in MODES:
        out, _ = generate(static, drafter, prompt, 40, mode=mode, eos_token_id=[], **params)
        assert out == ref
    assert set(seen) == {256, 512}  # the prompt and first steps within 256 slots, the rest within 512
    assert proposer.capture_spans()  # the spans no generation met
    assert all((*key, span) in proposer.graph_keys for key in proposer.captured for span in proposer.spans)


def _key_lengths(target) -> list[int]:
    """Records the number of key slots the first layer's attention reads in every forward."""
    seen: list[int] = []

    def hook(module, args, kwargs):
        if kwargs.get("attention_mask") is not None:  # None: the DynamicCache reference's causal forward
            seen.append(kwargs["attention_mask"].shape[-1])

    target.model.layers[0].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def test_attention_covers_the_context_not_the_capacity(tiny_llama_config):
    """The cost of a forward over the static storage grows with the slots its attention reads
    (sdpa with an explicit mask reads every one); a StaticTarget of large capacity must read only
    the smallest span holding the context: the product's bench verified a chain 7.4 ms per cycle
    with 8192 slots against 4.3 ms with 2048, for ~500-token contexts."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config).eval()
    cfg = DrafterConfig.from_target(tiny_llama_config, tiny_llama_config.vocab_size, [1, 2, 3])
    torch.manual_seed(1)
    drafter = prepare_drafter(Eagle3Drafter(cfg), target)
    static = StaticTarget(target, cfg.aux_layers, max_length=2048)
    assert static.spans == [256, 512, 1024, 2048]
    assert StaticTarget(target, cfg.aux_layers, max_length=2048, length_spans=False).spans == [2048]
    seen = _key_lengths(target)
    short, long = _prompts(1, target.config.vocab_size)[0], _prompts(1, target.config.vocab_size, seed=3)[0] * 49
    assert len(long) == 245  # its 20 new tokens cross from the 256-slot span into the 512-slot one
    for prompt in (short, long):
        ref, _ = target_generate(target, prompt, 20, eos_token_id=[])
        for mode, params in MODES:
            seen.clear()
            out, _ = generate(static, drafter, prompt, 20, mode=mode, eos_token_id=[], **params)
            assert out == ref
            assert set(seen) == ({256} if prompt is short else {256, 512}), (mode, sorted(set(seen)))


def test_target_graphs_per_span_and_capture_spans(tiny, monkeypatch):
    """The (width, span) graph plumbing with FakeGraph standing in for CUDA: the same tokens as
    the eager path, one graph per width and span met, ``capture_spans`` adds every span of those
    widths without changing what the storage holds."""
    import eagle3_ray.decode.static as static_mod

    graphs = _use_fake_graphs(monkeypatch, static_mod)
    target, drafter = tiny
    static = StaticTarget(target, drafter.config.aux_layers, max_length=1024, draft_graphs=False)
    static.cuda_graphs = True
    prompt = _prompts(1, target.config.vocab_size, seed=5)[0]
    ref, _ = target_generate(target, prompt, 12, eos_token_id=[])
    assert target_generate(static, prompt, 12, eos_token_id=[])[0] == ref
    assert generate(static, drafter, prompt, 12, mode="chain", num_steps=3, eos_token_id=[])[0] == ref
    assert static.graph_keys == [(1, 256), (4, 256)] and static.captured == [1, 4]
    before = static.storage.clone()
    assert static.capture_spans() == [(1, 512), (1, 1024), (4, 512), (4, 1024)]
    assert torch.equal(static.storage, before)  # captures put back the slots they wrote
    assert generate(static, drafter, prompt, 12, mode="chain", num_steps=3, eos_token_id=[])[0] == ref
    assert all(g.replays > 0 for g, key in zip(graphs, static.graph_keys) if key[1] == 256)


@pytest.mark.parametrize("use_static", [True, False], ids=["static", "dynamic"])
def test_top2_teacher_forced_on_the_audited_answer(tiny, use_static):
    """The audit's top-2 must be the baseline's logits in the baseline's own context: forced on a
    token list that greedy decoding would not produce, every step's top-2 equals the model's logits
    on prompt + the forced prefix, and the tokens returned are the argmax at each step."""
    target, drafter = tiny
    prompt = _prompts(1, target.config.vocab_size, seed=7)[0]
    greedy, _ = target_generate(target, prompt, 8, eos_token_id=[])
    forced = greedy[:3] + [(greedy[3] + 5) % target.config.vocab_size] + greedy[4:]  # off the greedy path at 3
    decoder = StaticTarget(target, drafter.config.aux_layers, max_length=64) if use_static else target
    argmax, top2 = target_top2(decoder, prompt, 8, eos_token_id=[], forced=forced)
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + forced])).logits[0, len(prompt) - 1:-1]  # [8, V]: before each
    assert argmax == logits.argmax(-1).tolist() and argmax[:4] == greedy[:4]
    torch.testing.assert_close(torch.tensor(top2)[:, :2], logits.topk(2, dim=-1).values, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(top2)[:, 2], logits.abs().amax(-1), rtol=1e-4, atol=1e-4)  # the row's scale
    free, free_top2 = target_top2(decoder, prompt, 8, eos_token_id=[])
    assert free == greedy and free_top2[:4] == top2[:4]  # the same forwards up to the forced token
    assert target_top2(decoder, prompt, 8, forced=[]) == ([], [])


def test_eager_forwards_run_without_cudnn_attention(tiny, monkeypatch):
    """The target's and the drafter's eager forwards (a prompt's own length) run inside the sdpa
    context without cuDNN (drafter.model.sdpa_for_growing_keys: a no-op off CUDA, so recorded here):
    cuDNN builds a plan per new shape, ~30 ms of host time on an H200, paid by whichever decoding mode
    meets a prompt length first (the bench's baseline and chain prefills: 65-67 ms a turn vs 31)."""
    import contextlib

    from eagle3_ray.decode import static as static_mod
    from eagle3_ray.decode import static_draft

    entered = []

    def recording(device):
        entered.append(torch.device(device).type)
        return contextlib.nullcontext()

    monkeypatch.setattr(static_mod, "sdpa_for_growing_keys", recording)
    monkeypatch.setattr(static_draft, "sdpa_for_growing_keys", recording)
    target, drafter = tiny
    static = StaticTarget(target, drafter.config.aux_layers, max_length=128)
    generate(static, drafter, _prompts(1, target.config.vocab_size)[0], 4, mode="chain", num_steps=2,
             eos_token_id=[])
    # Off CUDA every forward is eager: the target's prefill and verifies, the drafter's prompt extend and steps.
    assert len(entered) >= 4 and set(entered) == {"cpu"}


@pytest.fixture
def forward_widths(tiny):
    """(first position, width) of every forward of the tiny target over a static storage (an
    explicit mask); the hook is removed after the test."""
    seen: list[tuple[int, int]] = []

    def hook(module, args, kwargs):
        pos = kwargs.get("position_ids")
        if pos is not None and kwargs.get("attention_mask") is not None:
            seen.append((int(pos[0, 0]), pos.shape[-1]))

    handle = tiny[0].model.register_forward_pre_hook(hook, with_kwargs=True)
    yield seen
    handle.remove()


def test_chunked_prefill_gives_the_eager_prompt(tiny, forward_widths):
    """A prompt run as padded chunks of ``prefill_width`` (eagerly here, through the width's graph
    on CUDA) gives the one-forward prompt's logits and aux states, and the same generations."""
    target, drafter = tiny
    eager = StaticTarget(target, drafter.config.aux_layers, max_length=256)
    assert eager.prefill_width == 0  # off CUDA the default is one eager forward per prompt
    chunked = StaticTarget(target, drafter.config.aux_layers, max_length=256, prefill_width=8)
    seen = forward_widths
    for prompt in _prompts(3, target.config.vocab_size, seed=4):  # 5, 12 and 19 tokens: 1, 2 and 3 chunks
        ids = torch.tensor(prompt)
        ref = eager.runner(drafter.config.aux_layers).forward(ids)
        seen.clear()
        out = chunked.runner(drafter.config.aux_layers).forward(ids)
        assert [w for _, w in seen] == [8] * (-(-len(prompt) // 8))
        assert [p for p, _ in seen] == list(range(0, len(prompt), 8))
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.aux, ref.aux, rtol=1e-4, atol=1e-4)
        greedy, _ = target_generate(target, prompt, 12, eos_token_id=[])
        assert target_generate(chunked, prompt, 12, eos_token_id=[])[0] == greedy
        for mode, params in MODES:
            assert generate(chunked, drafter, prompt, 12, mode=mode, eos_token_id=[], **params)[0] == greedy


def test_chunked_prefill_through_graphs_shared_with_a_verify(tiny, forward_widths, monkeypatch):
    """With FakeGraph standing in for CUDA: the prompt's chunks replay the graph of their width,
    also when a tree's verify of the same width has left its depths and mask in that graph's
    buffers; a padded prompt over ``max_length`` runs as one eager forward instead."""
    import eagle3_ray.decode.static as static_mod

    graphs = _use_fake_graphs(monkeypatch, static_mod)
    target, drafter = tiny
    tree = dict(MODES)["tree"]
    width = tree["total_tokens"] + 1  # the tree's verify width
    static = StaticTarget(target, drafter.config.aux_layers, max_length=256, draft_graphs=False,
                          prefill_width=width)
    static.cuda_graphs = True
    for prompt in _prompts(3, target.config.vocab_size, seed=9):
        greedy, _ = target_generate(target, prompt, 16, eos_token_id=[])
        for _ in range(2):  # the second prompt's chunks replay after the tree's verifies
            assert generate(static, drafter, prompt, 16, mode="tree", eos_token_id=[], **tree)[0] == greedy
    assert static.captured == [width]  # prompts and verifies: one width, one graph
    assert graphs[0].replays > 6
    short = StaticTarget(target, drafter.config.aux_layers, max_length=30, prefill_width=16)
    prompt = _prompts(3, target.config.vocab_size, seed=9)[2]  # 19 tokens: 2 chunks = 32 slots > 30
    greedy, _ = target_generate(target, prompt, 8, eos_token_id=[])
    forward_widths.clear()
    assert target_generate(short, prompt, 8, eos_token_id=[])[0] == greedy
    assert forward_widths[0] == (0, 19)
    with pytest.raises(ConfigError, match="prefill_width"):
        StaticTarget(target, drafter.config.aux_layers, max_length=64, prefill_width=-1)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager-calls", "fake-graphs"])
def test_a_prompt_in_chunks_drafts_as_the_eager_one(tiny, graphs, monkeypatch):
    """Proposer level, fp32: a prompt extended in padded chunks of ``prompt_width`` (through that
    width's graph when graphs are on) leaves the eager Eagle3Proposer's state (the last row's output,
    the committed count) and gives its chains and trees, also after a commit; a prompt whose padded
    chunks would not fit ``max_length`` runs as one eager pass."""
    target, drafter = tiny
    width = 3 * target.config.hidden_size
    g = torch.Generator().manual_seed(3)
    chunk = 4
    widths: list[int] = []
    hook = drafter.midlayer.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    try:
        _chunked_prompts(target, drafter, graphs, monkeypatch, widths, chunk, width, g)
    finally:
        hook.remove()
    with pytest.raises(ConfigError, match="prompt_width"):
        StaticProposer(drafter, max_length=10, prompt_width=-1)


def _chunked_prompts(target, drafter, graphs, monkeypatch, widths, chunk, width, g):
    static = StaticProposer(drafter, max_length=160, prompt_width=chunk)
    if graphs:
        fakes = _use_fake_graphs(monkeypatch)
        static.cuda_graphs = True
    with torch.inference_mode():
        for n in (3, 4, 9, 13):  # one chunk padded, one exact, three and four chunks
            prompt = torch.randint(3, target.config.vocab_size, (n,), generator=g)
            aux = torch.randn(n, width, generator=g)
            eager = Eagle3Proposer(drafter)
            for p in (eager, static):
                p.begin(prompt)
            widths.clear()
            eager.extend(prompt, aux)
            assert widths == [n]
            widths.clear()
            static.extend(prompt, aux)
            if not graphs:  # replays of a graph run no module hooks of their own after the capture
                assert widths == [chunk] * -(-n // chunk)
            assert static.committed == eager.committed == n
            torch.testing.assert_close(static.hidden, eager.hidden, rtol=1e-5, atol=1e-5)
            assert eager.draft_chain(3, Sampling()).ids == static.draft_chain(3, Sampling()).ids
            ids, more = torch.randint(3, target.config.vocab_size, (2,), generator=g), torch.randn(2, width, generator=g)
            eager.extend(ids, more)
            static.extend(ids, more)
            a, b = eager.draft_tree(3, 4, 10), static.draft_tree(3, 4, 10)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    if graphs:
        assert ("extend", chunk) in static.captured and sum(f.replays for f in fakes) > 0
    near = StaticProposer(drafter, max_length=10, prompt_width=chunk)  # 9 pairs: 3 chunks = 12 slots > 10
    with torch.inference_mode():
        prompt = torch.randint(3, target.config.vocab_size, (9,), generator=g)
        near.begin(prompt)
        widths.clear()
        near.extend(prompt, torch.randn(9, width, generator=g))
    assert widths == [9] and near.committed == 9
