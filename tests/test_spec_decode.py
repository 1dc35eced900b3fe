"""Speculative decoding on HF targets: lossless greedy output, exact tau accounting, the drafter fed
as in training, tree drafting, and the sampled output distribution."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_ray.drafter.model import DrafterConfig, DrafterKVCache, Eagle3Drafter
from eagle3_ray.drafter.ttt import ttt_attention_mask
from eagle3_ray.errors import ConfigError
from eagle3_ray.decode import (
    Draft,
    DraftTree,
    Eagle3Proposer,
    generate,
    prepare_drafter,
    prompt_lookup_generate,
    target_generate,
)
from eagle3_ray.decode.sampling import Sampling, probs, verify_chain, verify_children


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _target(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _drafter(target_config, seed: int = 1, draft_vocab: int | None = None, aux_layers=None) -> Eagle3Drafter:
    layers = target_config.num_hidden_layers
    aux = aux_layers or [2, layers // 2, layers - 3]
    cfg = DrafterConfig.from_target(target_config, draft_vocab or target_config.vocab_size, aux)
    torch.manual_seed(seed)
    return Eagle3Drafter(cfg).eval()


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def _hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tiny(tiny_llama_config):
    target = _target(tiny_llama_config)
    return target, _drafter(tiny_llama_config)


class OracleProposer:
    """Test double: proposes the target's own greedy continuation, so every draft is accepted.

    No real drafter is right by construction; this one makes the accounting exact (tau = K + 1).
    It plugs into the same ``Proposer`` interface as the EAGLE-3 drafter and needs no aux states.
    """

    aux_layers: list[int] = []

    def __init__(self, target, horizon: int):
        self.target, self.horizon = target, horizon
        self.vocab = target.config.vocab_size

    def begin(self, prompt: torch.Tensor) -> None:
        ref, _ = target_generate(self.target, prompt, self.horizon, eos_token_id=[])
        self.sequence = prompt.tolist() + ref
        self.committed = 0

    def extend(self, next_ids: torch.Tensor, aux) -> None:
        self.committed += next_ids.shape[0]

    def _truth(self, i: int) -> int:
        """The target's greedy token i drafts ahead of the last committed one (i = 1, 2, ...)."""
        return self.sequence[self.committed + i]

    def _token(self, i: int) -> int:
        return self._truth(i)

    def draft_chain(self, k: int, s: Sampling) -> Draft:
        return Draft([self._token(i) for i in range(1, k + 1)], None)

    def draft_tree(self, topk: int, depth: int, total_tokens: int) -> DraftTree:
        """A path of ``depth`` proposals; each level also holds a wrong sibling, listed first."""
        tokens, parents, parent = [], [], -1
        for i in range(1, depth + 1):
            tokens += [(self._truth(i) + 1) % self.vocab, self._token(i)]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))


class WrongProposer(OracleProposer):
    """Test double: always proposes a token other than the target's argmax (tau must be 1)."""

    def _token(self, i: int) -> int:
        return (self._truth(i) + 1) % self.vocab


class FlakyOracleProposer(OracleProposer):
    """Test double: the oracle with 30% of its proposals corrupted (seeded), so verify steps accept
    every possible number of drafts and the cache rollback of partial acceptance is exercised."""

    def __init__(self, target, horizon: int, seed: int):
        super().__init__(target, horizon)
        self.rng = torch.Generator().manual_seed(seed)

    def _token(self, i: int) -> int:
        wrong = float(torch.rand((), generator=self.rng)) < 0.3
        return (self._truth(i) + 2) % self.vocab if wrong else self._truth(i)


def test_greedy_lossless_random_target_and_drafter(tiny):
    target, drafter = tiny
    for prompt in _prompts(3, target.config.vocab_size):
        ref = _hf_greedy(target, prompt, 24)
        assert generate(target, drafter, prompt, 24, mode="chain", num_steps=3)[0] == ref
        assert generate(target, drafter, prompt, 24, mode="tree", topk=3, depth=3, total_tokens=8)[0] == ref
        assert target_generate(target, prompt, 24)[0] == ref
        assert prompt_lookup_generate(target, prompt, 24, num_tokens=3)[0] == ref


def test_greedy_lossless_with_partial_acceptance(tiny):
    target, _ = tiny
    counts_chain, counts_tree = [0] * 5, [0] * 5
    for seed, prompt in enumerate(_prompts(3, target.config.vocab_size, seed=1)):
        ref = _hf_greedy(target, prompt, 30)
        out, stats = generate(target, FlakyOracleProposer(target, 40, seed), prompt, 30, mode="chain", num_steps=4)
        assert out == ref
        counts_chain = [a + b for a, b in zip(counts_chain, stats.accept_hist)]
        out, stats = generate(target, FlakyOracleProposer(target, 40, seed), prompt, 30, mode="tree", depth=4)
        assert out == ref
        counts_tree = [a + b for a, b in zip(counts_tree, stats.accept_hist)]
    assert all(counts_chain) and all(counts_tree), (counts_chain, counts_tree)  # 0..4 accepted all occurred


@pytest.mark.parametrize("mode,k", [("chain", 3), ("tree", 4)])
def test_oracle_tau_is_k_plus_one_and_wrong_tau_is_one(tiny, mode, k):
    target, _ = tiny
    prompt = _prompts(1, target.config.vocab_size)[0]
    steps = 5
    n = 1 + steps * (k + 1)  # the prefill token, then `steps` full verify steps
    params = {"num_steps": k} if mode == "chain" else {"depth": k}
    out, stats = generate(target, OracleProposer(target, n + k + 1), prompt, n, mode=mode, eos_token_id=[], **params)
    assert out == target_generate(target, prompt, n, eos_token_id=[])[0]
    assert stats.tau == k + 1 and stats.verify_steps == steps and stats.new_tokens == n
    assert stats.accept_by_position == [1.0] * k and stats.target_forwards == steps + 1

    out, stats = generate(target, WrongProposer(target, n + k + 1), prompt, n, mode=mode, eos_token_id=[], **params)
    assert out == target_generate(target, prompt, n, eos_token_id=[])[0]
    assert stats.tau == 1.0 and stats.verify_steps == n - 1 and stats.accept_by_position == [0.0] * k


def test_eos_is_kept_and_stops(tiny):
    target, drafter = tiny
    prompt = _prompts(1, target.config.vocab_size)[0]
    ref = target_generate(target, prompt, 12, eos_token_id=[])[0]
    eos = ref[5]
    stop = ref.index(eos) + 1
    for mode in ("chain", "tree"):
        out, stats = generate(target, drafter, prompt, 12, mode=mode, eos_token_id=eos)
        assert out == ref[:stop] and stats.new_tokens == stop


def test_smollm2_lossless_with_random_drafter(smollm2):
    target, tok = smollm2
    drafter = _drafter(target.config, draft_vocab=2048)
    for text in ("The capital of France is", "def fibonacci(n):\n"):
        prompt = tok(text)["input_ids"]
        ref = _hf_greedy(target, prompt, 16)
        assert generate(target, drafter, prompt, 16, mode="chain", num_steps=3)[0] == ref
        assert generate(target, drafter, prompt, 16, mode="tree", topk=3, depth=3, total_tokens=8)[0] == ref


def test_drafter_chain_is_the_training_unroll(tiny_llama_config):
    """Drafting K tokens after an incremental commit equals TTT's steps 0..K-1 at the last position."""
    target = _target(tiny_llama_config)
    drafter = prepare_drafter(_drafter(tiny_llama_config, seed=3), target)
    with torch.no_grad():  # sharp attention, so a wrong position or a stale key shows in the output
        drafter.midlayer.self_attn.q_proj.weight.mul_(8.0)
        drafter.midlayer.self_attn.k_proj.weight.mul_(8.0)
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(3, tiny_llama_config.vocab_size, (12,), generator=g)  # x_0..x_11
    aux = torch.randn(11, 3 * tiny_llama_config.hidden_size, generator=g)  # states at 0..10
    proposer = Eagle3Proposer(drafter)
    proposer.begin(seq[:6])
    proposer.extend(seq[1:7], aux[:6])
    proposer.draft_chain(3, Sampling())  # leaves draft keys in the cache, which the next extend drops
    proposer.extend(seq[7:12], aux[6:11])
    committed_hidden = proposer.hidden[0, -1]  # [H]
    drafts = proposer.draft_chain(3, Sampling()).ids

    # Training layout: step i feeds token x_{t+1+i} with step i-1's output, positions t + i.
    ids = torch.cat([seq, torch.tensor(drafts)])  # x_0..x_11, d_1..d_3
    pos, seq_ids = torch.arange(11)[None], torch.zeros(1, 11, dtype=torch.long)
    hidden, cache, expected = drafter.fuse(aux[None]), DrafterKVCache(), []
    with torch.no_grad():
        for i in range(3):
            hidden = drafter(ids[1 + i : 12 + i][None], hidden, pos + i, ttt_attention_mask(seq_ids, i), cache)
            if i == 0:
                torch.testing.assert_close(committed_hidden, hidden[0, -1])
            expected.append(int(drafter.draft_to_target(drafter.logits(hidden)[0, -1].argmax())))
    assert drafts == expected


def test_walked_chain_is_the_chain_decoding_of_the_same_text(tiny_llama_config):
    """The trainer's walked chain (``ttt_forward(walk_steps=K).walk``, its held-out val_tau_walk3) over
    the target's greedy answer has exactly the verify cycles and tokens of chain decoding that answer,
    with a drafter that accepts some drafts and misses others."""
    from eagle3_ray.drafter.ttt import ttt_forward

    config = copy.deepcopy(tiny_llama_config)
    config.initializer_range = 0.3  # the default 0.02 target repeats one token: every draft would be right
    target = _target(config)
    drafter = prepare_drafter(_drafter(config, seed=3), target)
    prompt = _prompts(1, config.vocab_size, seed=1)[0]
    answer, _ = target_generate(target, torch.tensor(prompt), 48)
    assert len(set(answer)) > 40
    seq = torch.tensor(prompt + answer)
    with torch.no_grad():
        states = target(seq[None], output_hidden_states=True).hidden_states
    a, n = len(prompt), len(seq)
    loss_mask = torch.zeros(1, n, dtype=torch.long)
    loss_mask[0, a:] = 1
    batch = {"input_ids": seq[None], "aux_hidden": torch.cat([states[k] for k in drafter.config.aux_layers], -1),
             "last_hidden": states[-1], "loss_mask": loss_mask, "position_ids": torch.arange(n)[None],
             "seq_ids": torch.zeros(1, n, dtype=torch.long)}
    lm_head = target.lm_head.weight.detach()
    # A few steps on this very text: some drafts right, some wrong.
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    drafter.train()
    for _ in range(20):
        opt.zero_grad()
        ttt_forward(drafter, batch, lm_head, ttt_steps=3).loss.backward()
        opt.step()
    drafter.eval()
    out, stats = generate(target, drafter, prompt, 48, mode="chain", num_steps=3)
    assert out == answer
    assert all(stats.accept_hist), stats.accept_hist  # cycles that accepted 0, 1, 2 and 3 drafts
    with torch.no_grad():
        walk = ttt_forward(drafter, batch, lm_head, ttt_steps=3, walk_steps=3).walk
    assert walk.tolist() == [stats.new_tokens - 1, stats.verify_steps]


def test_tree_children_are_the_drafter_top_k(tiny_llama_config):
    """Every expanded node's children are the drafter's top-k after that node's path (mask, positions)."""
    target = _target(tiny_llama_config)
    drafter = prepare_drafter(_drafter(tiny_llama_config, seed=4, draft_vocab=256), target)
    g = torch.Generator().manual_seed(6)
    seq = torch.randint(3, tiny_llama_config.vocab_size, (9,), generator=g)
    aux = torch.randn(8, 3 * tiny_llama_config.hidden_size, generator=g)
    k, depth = 3, 3
    proposer = Eagle3Proposer(drafter)
    proposer.begin(seq[:8])
    proposer.extend(seq[1:], aux)
    tree = proposer.draft_tree(k, depth, total_tokens=k + (depth - 1) * k * k)
    kids = tree.children()
    tokens = [-1] + tree.tokens.tolist()
    parent = [-1] + [p + 1 for p in tree.parents.tolist()]
    expanded = [n for n in range(len(tokens)) if kids[n]]
    assert len(expanded) == 1 + k + k  # the root, all of depth 1, the best k of depth 2
    for node in expanded:
        path, up = [], node
        while up > 0:
            path.insert(0, tokens[up])
            up = parent[up]
        fresh = Eagle3Proposer(drafter)
        fresh.begin(seq[:8])
        fresh.extend(seq[1:], aux)
        h = fresh.hidden
        with torch.no_grad():
            for i, t in enumerate(path):  # chain-feed the path, causal over the committed cache
                h = drafter(torch.tensor([[t]]), h, torch.tensor([[8 + i]]), cache=fresh.cache)
            top = drafter.draft_to_target(drafter.logits(h)[0, -1].topk(k).indices)
        assert [tokens[c] for c in kids[node]] == top.tolist()


def _check_distribution(samples: list[int], expected: torch.Tensor) -> None:
    """Pearson chi-square goodness of fit at significance 1e-4 (tokens expected < 5 times pooled).

    Runs are seeded, so the verdict is deterministic; the level only says how unlucky a correct
    implementation would have to be to fail.
    """
    n = len(samples)
    observed = torch.bincount(torch.tensor(samples), minlength=expected.shape[0]).double()  # [V]
    want = expected.double() * n  # [V]
    small = want < 5
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    want = torch.cat([want[~small], want[small].sum()[None]])
    keep = want > 0
    assert float(observed[~keep].sum()) == 0, "a token of probability 0 was generated"
    chi2 = float(((observed[keep] - want[keep]) ** 2 / want[keep]).sum())
    df = int(keep.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + 3.72 * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty, z(1e-4)
    assert chi2 < critical, (chi2, critical, observed.tolist(), want.tolist())


def test_rejection_rules_reproduce_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    s = Sampling(1.0, 1.0, g)
    p = torch.tensor([0.5, 0.3, 0.1, 0.07, 0.03])
    q = torch.tensor([0.1, 0.2, 0.2, 0.2, 0.3])
    n = 4000
    chain, tree = [], []
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=g))
        accepted, token = verify_chain(torch.stack([p, p]).log(), [x], q[None], s)
        chain.append(x if accepted else token)
        j, token = verify_children(p, [4, 2, 1], s)  # deterministic children, worst-first
        tree.append([4, 2, 1][j] if j is not None else token)
    _check_distribution(chain, p)
    _check_distribution(tree, p)


@pytest.fixture(scope="module")
def peaked():
    """A 16-token target with a peaked distribution and a near-uniform random drafter: they overlap
    enough that half the drafts are accepted and a wrong residual visibly biases the output."""
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    target = _target(config, seed=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(10.0)  # random init is near uniform; make p peaked
        drafter = _drafter(config, seed=3, aux_layers=[1, 2, 3])
    return target, drafter


@pytest.mark.parametrize(
    "mode,params", [("chain", {"num_steps": 2}), ("tree", {"topk": 4, "depth": 2, "total_tokens": 6, "top_p": 0.9})]
)
def test_sampled_tokens_follow_the_target_distribution(peaked, mode, params):
    """Token 2 is the first one a verify step decides (token 1 comes from the prefill logits)."""
    target, drafter = peaked
    temperature, top_p = 0.8, params.get("top_p", 1.0)
    prompt = [5, 9, 3, 12]
    with torch.no_grad():
        p1 = probs(target(torch.tensor([prompt])).logits[0, -1], Sampling(temperature, top_p))  # [16]
        two = torch.tensor([prompt + [t] for t in range(16)])
        p2 = probs(target(two).logits[:, -1], Sampling(temperature, top_p))  # [16, 16]: p(t2 | t1)
    expected = p1 @ p2  # marginal of token 2
    second, accepted = [], 0
    for seed in range(1600):
        out, stats = generate(
            target, drafter, prompt, 2, mode=mode, temperature=temperature, seed=seed, eos_token_id=[], **params
        )
        second.append(out[1])
        accepted += stats.accept_hist[0] == 0
    _check_distribution(second, expected)
    assert 100 < accepted < 1500, accepted  # both acceptance and rejection were exercised


def test_bad_arguments_raise_config_errors(tiny):
    target, drafter = tiny
    with pytest.raises(ConfigError, match="mode"):
        generate(target, drafter, [5, 6], 4, mode="beam")
    with pytest.raises(ConfigError, match="unknown parameters"):
        generate(target, drafter, [5, 6], 4, mode="chain", topk=3)
    with pytest.raises(ConfigError, match="num_steps"):
        generate(target, drafter, [5, 6], 4, num_steps=0)
    with pytest.raises(ConfigError, match="1-D"):
        generate(target, drafter, [[5, 6], [7, 8]], 4)
    with pytest.raises(ConfigError, match="temperature"):
        generate(target, drafter, [5, 6], 4, temperature=-1.0)


def test_stats_accounting_is_consistent(tiny):
    target, drafter = tiny
    out, stats = generate(target, drafter, [5, 6, 7], 10, mode="chain", num_steps=2, eos_token_id=[])
    d = stats.to_dict()
    assert len(out) == d["new_tokens"] == 10
    assert d["verify_steps"] == sum(d["accept_hist"]) and d["target_forwards"] == d["verify_steps"] + 1
    assert math.isclose(d["tau"] * d["verify_steps"], d["new_tokens"] - 1)
    assert d["tokens_per_s"] > 0
