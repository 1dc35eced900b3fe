"""The drafter side of speculative decoding on a preallocated KV cache, replayed as CUDA graphs.

``StaticProposer`` is a ``Proposer`` (``decode/drafts.py``) over the same EAGLE-3 drafter as
``Eagle3Proposer`` (the eager reference), with the drafter's one attention layer reading and
writing a preallocated storage ``[1, kv_heads, max_length, head_dim]`` instead of a growing cache:

* every write goes to explicit slots (slot = drafter position), and every call attends over the
  first ``span`` slots of the storage (the smallest of ``spans``, ``decode/spans.py``, holding the
  committed and new keys: a masked attention reads every slot it is given) with a mask computed on
  the device from the committed length, so a call has one shape per (width, span) whatever the
  context length, and never reads the host;
* rolling back is free: draft-step keys past the committed length stay in the storage, masked,
  until the next call overwrites them;
* a commit after a verify (``extend``) is padded to a fixed width (the widest commit of the mode:
  K+1 for a chain, depth+1 for a tree) by repeating its last pair; the padding rows sit after the
  real ones, so causality hides them from the real rows, and their keys land on slots the next call
  overwrites before anything reads them.

So the chain draft of K steps, the EAGLE-2 tree expansion of (topk, depth) and the commit of each
width are fixed-shape functions; on CUDA each is captured once per span as a CUDA graph and replayed.
A commit after a verify is held until the next draft and runs first inside that draft's graph (key
``("extend", W, *draft key)``), so a chain cycle is two graph replays, the draft with its commit
and the target's verify (a read of ``hidden`` in between runs the commit alone). Greedy decoding goes
further (``chain_after_verify`` / ``tree_after_verify``, key ``("verified", verify width, *draft key)``): the
graph takes the verify's argmax and the accepted nodes as device tensors and selects the pairs to commit
itself, so the commit and the next draft are queued behind the verify before the host reads its
verdict, and the host accepts while the device drafts. A tree's graph also
selects its nodes and lays out the verify's positions and mask, ``spec.tree.select_nodes``). A prompt
runs as padded chunks of ``prompt_width`` through that width's graph, as the target's prefill does (or
as one eager pass without it: a prompt's length varies). Off CUDA, and for sampled chains (the
sampler's generator lives on the host side), the same functions run eagerly. ``StaticTarget.proposer``
builds one per drafter next to the target's storage, so the verify and the draft share one
preallocated state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from eagle3_ray.drafter.model import Eagle3Drafter, sdpa_for_growing_keys
from eagle3_ray.errors import ConfigError
from eagle3_ray.decode.drafts import Draft, DraftTree
from eagle3_ray.decode.sampling import Sampling, probs
from eagle3_ray.decode.spans import attention_spans, span_for
from eagle3_ray.decode.tree import accepted_order, eagle2_depths, select_nodes

log = logging.getLogger(__name__)

MAX_DRAFT_GRAPHS = 8  # distinct steps (function, shape) captured per proposer at most, each once per span


class StaticDrafterCache:
    """``DrafterKVCache``'s interface over a preallocated storage: ``append`` writes the new keys at
    ``pos`` and returns the first ``span`` slots (views); callers pass a mask over exactly those."""

    growing = False  # fixed shapes: keep torch's sdpa backend choice (drafter.model.attention_backends)

    def __init__(self, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.zeros(1, kv_heads, length, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos: torch.Tensor | None = None  # [T] long: slots of the next append
        self.span = length  # slots the next attention reads (the proposer sets it per call)

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.index_copy_(2, self.pos, k)
        self.v.index_copy_(2, self.pos, v)
        return self.k[:, :, : self.span], self.v[:, :, : self.span]


def capture_graph(fn: Callable[..., object], buf: dict[str, torch.Tensor], device: torch.device):
    """Warm ``fn(**buf)`` up twice on a side stream (lazy inits, workspaces), then capture it;
    returns (graph, outputs). Replays read ``buf`` and overwrite the outputs in place."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(**buf)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(**buf)
    return graph, out


class StaticProposer:
    """An ``Eagle3Drafter`` (on the target's device/dtype, embedding bound) over a static KV cache,
    its chain / tree / commit steps replayed as CUDA graphs (see module doc).

    ``max_length``: drafter positions of the longest generation (prompt + new tokens) plus the
    widest draft (K for a chain, (depth - 1) * topk for a tree); ``StaticTarget.proposer`` sizes it
    from the target's. ``cuda_graphs``: capture graphs (CUDA only; ignored elsewhere).
    ``prompt_width``: extend over a prompt in chunks of this many pairs, the last one padded, each
    through the graph of that width (as ``StaticTarget``'s chunked prefill; 0: one eager pass).
    """

    def __init__(self, drafter: Eagle3Drafter, max_length: int, cuda_graphs: bool = True, prompt_width: int = 0):
        cfg = drafter.config
        weight = drafter.fc.weight
        self.drafter = drafter
        self.aux_layers = list(cfg.aux_layers)
        self.device, self.dtype = weight.device, weight.dtype
        self.max_length = max_length
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.cache = StaticDrafterCache(cfg.num_key_value_heads, max_length, cfg.head_dim, self.dtype, self.device)
        self._keys = torch.arange(max_length, device=self.device)  # [S]
        self.spans = attention_spans(max_length)  # a step attends over the smallest span holding it
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], object] | None] = {}
        self._steps: dict[tuple, tuple[Callable[..., object], dict[str, torch.Tensor | int], int]] = {}
        self.captured: list[tuple] = []  # step keys with a graph, in capture order
        self.graph_keys: list[tuple] = []  # step key + (span,) of every graph, in capture order
        self.capture_errors: dict[str, str] = {}  # graph key -> why its capture failed (that step then runs eagerly)
        self._pad = 1  # commit width after a verify: set by the last draft (K+1 / depth+1)
        if prompt_width < 0:
            raise ConfigError(f"prompt_width={prompt_width}: give 0 (eager prompts) or a chunk width")
        self.prompt_width = prompt_width
        self.begin(torch.empty(0))

    # -- the Proposer interface ----------------------------------------------------------------
    def begin(self, prompt: torch.Tensor) -> None:
        self.committed = 0  # drafter positions backed by target states, a pending commit included
        self._hidden: torch.Tensor | None = None  # [1, 1, H] output that predicts the next draft token
        self._pending: tuple[torch.Tensor, torch.Tensor, int, int] | None = None  # (ids, aux, past, m) padded
        self._unsettled: int | None = None  # past of a commit decided on the device, its size not yet read

    @property
    def hidden(self) -> torch.Tensor | None:
        """The output that predicts the next draft token (runs a pending commit on its own)."""
        self._settled()
        self._flush()
        return self._hidden

    @torch.inference_mode()
    def extend(self, next_ids: torch.Tensor, aux: torch.Tensor | None) -> None:
        assert aux is not None and aux.shape[0] == next_ids.shape[0], "EAGLE-3 needs one aux state per token"
        self._settled()
        m = next_ids.shape[0]
        ids, aux = next_ids.to(self.device), aux.to(self.device)
        c = self.prompt_width
        if self.committed == 0 and c and -(-m // c) * c <= self.max_length:
            # A prompt in chunks of c through their graph: eagerly, its ~50-75 drafter kernels were
            # launched one by one, milliseconds a turn (the chain's prefill: 8.2 ms against the
            # target-only 4.8 on an H200, benchmarks/results/README.md, the 2026-12-03 night session).
            for lo in range(0, m, c):
                self._extend_padded(ids[lo:lo + c], aux[lo:lo + c], c, f"a prompt chunk of {c}", graph=True)
            return
        if self.committed == 0:  # a prompt: its own length, eagerly
            self._extend_padded(ids, aux, m, f"a commit of {m}", graph=False)
            return
        # A commit after a verify: padded to the mode's widest, and held until the next draft, whose
        # graph runs it first (one replay a cycle instead of two; module doc).
        self._flush()
        width = max(m, self._pad)
        self._fits(self.committed + width, f"a commit of {width}")
        self._pending = (*_padded(ids, aux, width), self.committed, m)
        self.committed += m

    def _extend_padded(self, ids: torch.Tensor, aux: torch.Tensor, width: int, what: str, graph: bool) -> None:
        m = ids.shape[0]
        ids, aux = _padded(ids, aux, width)
        self._hidden = self._call(("extend", width), self._extend,
                                  {"ids": ids, "aux": aux, "past": self.committed, "last": m - 1},
                                  width, what, graph=graph)
        self.committed += m

    def _flush(self) -> None:
        """Run a pending commit on its own (a draft that cannot take it into its graph, a read of ``hidden``)."""
        if self._pending is None:
            return
        ids, aux, past, m = self._pending
        self._pending = None
        width = ids.shape[0]
        self._hidden = self._call(("extend", width), self._extend, {"ids": ids, "aux": aux, "past": past, "last": m - 1},
                                  width, f"a commit of {width}", graph=True, past=past)

    def _draft(self, key: tuple, fn: Callable[..., tuple], width: int, what: str):
        """``fn(hidden, past) -> outputs`` after the committed pairs, through its graph; a pending commit
        runs first inside the same graph (key ``("extend", W) + key``)."""
        if self._pending is None:
            return self._call(key, fn, {"hidden": self.hidden, "past": self.committed}, width, what, graph=True)
        ids, aux, past, m = self._pending
        self._pending = None
        w = ids.shape[0]

        def fused(ids, aux, past, last):
            hidden = self._extend(ids, aux, past, last)
            return *fn(hidden, past + last + 1), hidden

        # Slots: the commit's w from past, then the draft's from past + m <= past + w.
        *out, self._hidden = self._call(("extend", w, *key), fused, {"ids": ids, "aux": aux, "past": past, "last": m - 1},
                                        w + width, f"a commit of {w} and {what}", graph=True, past=past)
        return tuple(out)

    @torch.inference_mode()
    def draft_chain(self, k: int, s: Sampling) -> Draft:
        self._settled()
        self._pad = k + 1
        what = f"a chain of {k} drafts"
        if s.greedy:
            fn = lambda hidden, past: (self._chain(hidden, past, k),)  # noqa: E731
            (ids,) = self._draft(("chain", k), fn, k, what)
            return Draft(ids, None)  # on the device: the verify reads it without a host sync
        fn = lambda hidden, past: self._chain_sampled(hidden, past, k, s)  # noqa: E731
        ids, qs = self._call(("chain-sampled", k), fn, {"hidden": self.hidden, "past": self.committed}, k, what,
                             graph=False)  # the sampler's generator lives on the host side: eagerly
        return Draft(ids, qs)

    @torch.inference_mode()
    def chain_after_verify(self, best: torch.Tensor, accepted: torch.Tensor, aux: torch.Tensor, k: int) -> Draft:
        """A greedy verify's commit and the next chain of ``k`` drafts in one replay (``_verified``)."""
        fn = lambda hidden, past: (self._chain(hidden, past, k),)  # noqa: E731
        (ids,) = self._after_verify(("chain", k), fn, best, accepted, aux, k + 1, k, f"a chain of {k} drafts")
        return Draft(ids, None)

    @torch.inference_mode()
    def tree_after_verify(self, best: torch.Tensor, accepted: torch.Tensor, aux: torch.Tensor, topk: int, depth: int,
                          total_tokens: int) -> DraftTree:
        """A greedy verify's commit and the next draft tree in one replay (``_verified``)."""
        key, fn = self._tree_step(topk, depth, total_tokens)
        return DraftTree(*self._after_verify(key, fn, best, accepted, aux, depth + 1, (depth - 1) * topk,
                                             f"a tree of depth {depth} and top-{topk}"))

    def _after_verify(self, key: tuple, fn: Callable[..., tuple], best: torch.Tensor, accepted: torch.Tensor,
                      aux: torch.Tensor, pad: int, width: int, what: str) -> tuple:
        """The commit of a greedy verify's accepted nodes, decided on the device, then ``fn`` (the next
        draft) in the same graph, so nothing waits for the host to read the verdict (``spec.chain`` and
        ``spec.tree``'s greedy loops queue it right behind the verify).

        ``best`` [N+1]: the target's argmax at the root and at each verified draft; ``accepted`` [N+1]
        bool: the root and the drafts greedy acceptance keeps, a path (ancestors before descendants);
        ``aux`` [N+1, A*Ht]: the target's states there. Each accepted node's state is committed with
        the target's argmax there (the next accepted draft, or the target's own token at the end), padded
        to ``pad`` pairs by repeating the last. Call ``settle(len(path))`` once the host has read it."""
        self._settled()
        self._flush()
        self._pad = pad
        past = self.committed
        fused = lambda best, accepted, aux, past: self._verified(best, accepted, aux, past, fn, pad)  # noqa: E731
        *out, self._hidden = self._call(("verified", best.shape[0], *key), fused,
                                        {"best": best, "accepted": accepted, "aux": aux, "past": past}, pad + width,
                                        f"a commit of up to {pad} and {what}", graph=True, past=past)
        self._unsettled = past
        return tuple(out)

    def settle(self, m: int) -> None:
        """The size of the commit ``chain_after_verify`` / ``tree_after_verify`` decided on the device
        (the root and the accepted drafts)."""
        assert self._unsettled is not None, "settle() follows chain_after_verify() or tree_after_verify()"
        self.committed, self._unsettled = self._unsettled + m, None

    def _settled(self) -> None:
        if self._unsettled is not None:
            raise RuntimeError("the drafter state waits for settle(): call it with the accepted count + 1 "
                               "after chain_after_verify / tree_after_verify and before any other proposer call")

    @torch.inference_mode()
    def draft_tree(self, topk: int, depth: int, total_tokens: int) -> DraftTree:
        self._settled()
        self._pad = depth + 1
        key, fn = self._tree_step(topk, depth, total_tokens)
        return DraftTree(*self._draft(key, fn, (depth - 1) * topk, f"a tree of depth {depth} and top-{topk}"))

    def _tree_step(self, topk: int, depth: int, total_tokens: int) -> tuple[tuple, Callable[..., tuple]]:
        if topk > self.drafter.config.draft_vocab_size:
            raise ConfigError(f"topk={topk} exceeds the drafter's vocabulary "
                              f"({self.drafter.config.draft_vocab_size}); lower it")

        def fn(hidden, past):  # the expansion, the selection and the verify's layout: one graph
            tree = select_nodes(*self._tree(hidden, past, topk, depth), total_tokens,
                                eagle2_depths(topk, depth, self.device))
            return tree.tokens, tree.parents, tree.depth, tree.visible

        return ("tree", topk, depth, total_tokens), fn

    # -- fixed-shape functions: run eagerly or captured ------------------------------------------
    def _extend(self, ids, aux, past, last) -> torch.Tensor:
        """ids [W], aux [W, A*Ht], past [] long, last [] long -> [1, 1, H] output of row ``last``."""
        w = ids.shape[0]
        pos = past + torch.arange(w, device=self.device)  # [W] positions = slots
        self.cache.pos = pos
        mask = (self._keys[None, : self.cache.span] <= pos[:, None])[None, None]  # [1, 1, W, S]: causal over the span
        d = self.drafter
        out = d(ids[None], d.fuse(aux[None]), pos[None], attention_mask=mask, cache=self.cache)  # [1, W, H]
        return out.index_select(1, last.view(1))

    def _step(self, token: torch.Tensor, hidden: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """One chain draft step: ``token`` [1] at position/slot ``at`` [] -> [1, 1, H]."""
        pos = at.view(1)
        self.cache.pos = pos
        mask = (self._keys[: self.cache.span] <= at)[None, None, None]  # [1, 1, 1, S]
        return self.drafter(token.view(1, 1), hidden, pos.view(1, 1), attention_mask=mask, cache=self.cache)

    def _chain(self, hidden, past, k: int) -> torch.Tensor:
        """Greedy chain of ``k`` drafts -> [k] target ids (on the device)."""
        d, h, ids = self.drafter, hidden, []
        for i in range(k):
            token = d.draft_to_target(d.logits(h)[0, -1].argmax().view(1))  # [1]: a 0-d index would sync
            ids.append(token)
            if i + 1 < k:
                h = self._step(token, h, past + i)
        return torch.cat(ids)

    def _verified(self, best, accepted, aux, past, fn: Callable[..., tuple], pad: int) -> tuple:
        """``_after_verify``'s graph: the commit of the accepted nodes, then ``fn(hidden, past)`` after it
        -> (``fn``'s outputs, [1, 1, H] the commit's last output)."""
        n = accepted.sum()  # [] pairs to commit: the root and the accepted drafts
        padded = torch.arange(pad, device=self.device).clamp(max=n - 1)  # 0..n-1, then n-1 repeated
        rows = accepted_order(accepted).index_select(0, padded)  # the accepted nodes in path order, padded
        hidden = self._extend(best.index_select(0, rows), aux.index_select(0, rows), past, n - 1)
        return *fn(hidden, past + n), hidden

    def _chain_sampled(self, hidden, past, k: int, s: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
        d, h, ids, qs = self.drafter, hidden, [], []
        rows = d.draft_to_target(torch.arange(d.config.draft_vocab_size, device=self.device))
        for i in range(k):
            q = probs(d.logits(h)[0, -1], s)  # [Vd]
            token = d.draft_to_target(torch.multinomial(q, 1, generator=s.generator))  # [1]
            ids.append(token)
            qs.append(q.new_zeros(d.config.vocab_size).index_copy(0, rows, q))
            if i + 1 < k:
                h = self._step(token, h, past + i)
        return torch.cat(ids), torch.stack(qs)

    def _tree(self, hidden, past, topk: int, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``spec.tree.eagle2_tree`` over the static cache: expansion d (1-based) writes its ``topk``
        keys at slots past + (d-1)*topk ..; returns every drafted node's (target id, cumulative
        log-prob, parent) before selection."""
        d, dev = self.drafter, self.device
        logp = d.logits(hidden)[0, -1].float().log_softmax(-1)  # [Vd]
        scores, ids = logp.topk(topk)
        all_ids, all_scores, all_parents = [ids], [scores], [torch.full((topk,), -1, device=dev)]
        frontier = torch.arange(topk, device=dev)
        frontier_hidden = hidden.expand(1, topk, -1)  # [1, k, H]
        seen = torch.zeros(topk, 0, dtype=torch.bool, device=dev)  # [k, E] earlier expansion keys each row sees
        eye = torch.eye(topk, dtype=torch.bool, device=dev)
        rel = self._keys[: self.cache.span] - past  # [S] slot relative to the first expansion key
        count = topk
        for level in range(1, depth):
            visible_new = torch.cat([seen, eye], dim=1)  # [k, level*k] over the expansion slots so far
            n = visible_new.shape[1]
            inside = (rel >= 0) & (rel < n)
            mask = (rel < 0) | (inside & visible_new.gather(1, rel.clamp(0, n - 1).expand(topk, -1)))  # [k, S]
            self.cache.pos = past + (level - 1) * topk + torch.arange(topk, device=dev)
            out = d(d.draft_to_target(ids)[None], frontier_hidden, (past + level - 1).expand(1, topk),
                    attention_mask=mask[None, None], cache=self.cache)  # [1, k, H]
            child_logp, child_ids = d.logits(out)[0].float().log_softmax(-1).topk(topk, dim=-1)  # [k, k]
            cand = (scores[:, None] + child_logp).flatten()
            all_ids.append(child_ids.flatten())
            all_scores.append(cand)
            all_parents.append(frontier.repeat_interleave(topk))
            scores, best = cand.topk(topk)
            rows = best // topk
            ids = child_ids.flatten()[best]
            frontier = count + best
            frontier_hidden = out[:, rows]
            seen = visible_new[rows]
            count += topk * topk
        return d.draft_to_target(torch.cat(all_ids)), torch.cat(all_scores), torch.cat(all_parents)

    # -- graphs -------------------------------------------------------------------------------
    def _call(self, key: tuple, fn: Callable[..., object], args: dict[str, torch.Tensor | int], width: int,
              what: str, graph: bool, past: int | None = None):
        """``fn(**args)`` attending over the smallest span holding the ``width`` slots it writes after
        ``past`` (default: the committed ones), through the graph of (``key``, span) when graphs are
        on (captured on first use); int arguments become 0-d long tensors."""
        past = self.committed if past is None else past
        self._fits(past + width, what)
        span = span_for(self.spans, past + width)
        entry = None
        if graph and self.cuda_graphs:
            self._steps.setdefault(key, (fn, args, width))
            entry = self._graph(key, span)
        if entry is None:  # eagerly (a prompt's own length): without cuDNN's per-shape plans, as StaticTarget
            self.cache.span = span
            with sdpa_for_growing_keys(self.device):
                return fn(**{k: torch.tensor(v, device=self.device) if isinstance(v, int) else v
                             for k, v in args.items()})
        g, buf, out = entry
        for name, value in args.items():
            if isinstance(value, int):  # a count: a fill kernel, no host-to-device copy
                buf[name].fill_(value)
            else:
                buf[name].copy_(value, non_blocking=True)
        g.replay()
        # Copies: the next replay overwrites the graph's outputs.
        return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()

    @torch.inference_mode()
    def capture_spans(self) -> list[tuple]:
        """Capture every span of every step captured so far (after a warm-up generation per mode, so
        no capture lands in a timed one); returns the new graph keys."""
        before = len(self.graph_keys)
        for key in list(self.captured):
            width = self._steps[key][2]
            for span in self.spans:
                if span >= width:
                    self._graph(key, span)
        return self.graph_keys[before:]

    def _graph(self, key: tuple, span: int):
        if (*key, span) not in self._graphs and (key in self.captured or len(self.captured) < MAX_DRAFT_GRAPHS):
            fn, args, width = self._steps[key]
            buf = {name: torch.tensor(value, device=self.device) if isinstance(value, int) else value.clone()
                   for name, value in args.items()}
            # Warm-up and capture write keys into the span's last slots; what the generation has there
            # is saved and put back, so a capture in the middle of a generation changes nothing.
            lo = span - max(width, 1)
            buf["past"].fill_(lo)
            if "last" in buf:
                buf["last"].fill_(0)
            saved = self.cache.k[:, :, lo:span].clone(), self.cache.v[:, :, lo:span].clone()
            self.cache.span = span
            try:
                graph, out = capture_graph(fn, buf, self.device)
                self._graphs[(*key, span)] = (graph, buf, out)
                if key not in self.captured:
                    self.captured.append(key)
                self.graph_keys.append((*key, span))
                log.debug("captured the drafter graph %s over span %d", key, span)
            except RuntimeError as e:  # a kernel that cannot be captured: this step stays eager, said loudly
                torch.cuda.synchronize(self.device)
                self._graphs[(*key, span)] = None
                self.capture_errors[str((*key, span))] = f"{type(e).__name__}: {e}"
                log.warning("the drafter step %s could not be captured as a CUDA graph and runs eagerly: %s", key, e)
            finally:
                self.cache.k[:, :, lo:span].copy_(saved[0])
                self.cache.v[:, :, lo:span].copy_(saved[1])
        return self._graphs.get((*key, span))

    def _fits(self, slots: int, what: str) -> None:
        if slots > self.max_length:
            raise ConfigError(
                f"{what} needs {slots} drafter cache slots, the static drafter holds max_length={self.max_length}; "
                "build the StaticTarget with a larger max_length or ask for fewer tokens"
            )


def _padded(ids: torch.Tensor, aux: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat the last pair up to ``width`` rows: padding rows come after the real ones (module doc)."""
    m = ids.shape[0]
    if width <= m:
        return ids, aux
    return torch.cat([ids, ids[-1:].expand(width - m)]), torch.cat([aux, aux[-1:].expand(width - m, -1)])
