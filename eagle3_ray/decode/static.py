"""The target side of speculative decoding on a preallocated KV cache, replayed as CUDA graphs.

A 135M-8B target at batch 1 is launch-bound: one forward of 1 to 64 new tokens costs the same few
hundred kernel launches whatever its width. ``StaticTarget`` removes that cost: it owns one KV
storage for every layer, ``[L, 2, kv_heads, max_length, head_dim]``, and captures one CUDA graph
per forward width it sees (1 for plain decoding, K+1 for a chain, total_tokens+1 for a tree)
and attention span, then replays it. Build it once per process and pass it as ``target`` to ``decode.generate`` /
``spec.target_generate``; every generation reuses the storage and the graphs.

Everything a forward depends on lives in device tensors the graph reads: the token ids, the
committed length ``past``, each new token's depth (position offset) and the tree mask among the
new tokens. From them the graphed function itself computes the positions, the cache slots the new
keys go to (``past + j``) and an additive mask over the attended slots: key s is visible to new
token q iff s < past, or s = past + r with r an ancestor-or-self of q.

Attention spans: with an explicit mask, sdpa cannot use its flash kernel, and the kernels it uses
read every key slot they are given; a forward attending over the whole storage therefore costs in
proportion to ``max_length``, not to the context (SmolLM2-135M on an H200, chain(3) verify: 4.3 ms
at max_length 2048, 7.4 ms at 8192; benchmarks/results/README.md). So a forward attends only over
the first ``span`` slots, the smallest of ``spans`` (``MIN_SPAN``, doubling, up to ``max_length``)
holding the committed and new tokens, and each (width, span) has its own graph:
``capture_spans`` captures every span of the widths seen so far, so no capture lands later in a
timed generation. Rolling back is therefore
free: rejected drafts stay in the storage past the committed length, invisible, and the next
forward overwrites them. A tree's accepted path is moved down to consecutive slots with one
gather over all layers.

The drafter gets the same treatment next to this storage: ``proposer(drafter)`` is its
``StaticProposer`` (``decode/static_draft.py``), used by ``decode.generate`` when ``draft_graphs``.

Prompts: an eager forward of a prompt is launch-bound too (about 30 ms for SmolLM2-135M on an H200, paid in
every decoding mode, a tenth of a 128-token turn). With ``prefill_width`` C, a prompt runs as
ceil(T / C) forwards of C tokens through the width-C graphs, the last chunk padded: the padding's keys
land past the committed length, invisible, and the next forward overwrites them.

Off CUDA (CPU tests) the same function runs eagerly, so graph replay and the eager path share
every line but the capture. Its graph safety (no host sync inside the forward) is tested on CPU
by failing on every op that would read a device value on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from eagle3_ray.drafter.model import Eagle3Drafter, sdpa_for_growing_keys
from eagle3_ray.engines.hidden_states import HiddenStateSelection
from eagle3_ray.engines.static_cache import MASKABLE_ATTENTION, SlotLayer, Slots, cache_api
from eagle3_ray.errors import ConfigError
from eagle3_ray.decode.spans import attention_spans, span_for
from eagle3_ray.decode.static_draft import StaticProposer, capture_graph
from eagle3_ray.decode.target import TargetOut

PREFILL_WIDTH = 256  # prompt chunk of the graphed prefill (CUDA graphs on); padding is free for a launch-bound target
MAX_GRAPH_WIDTH = 256  # default widest graphed forward; a tree of 64-80 drafted tokens verifies 65-81 wide
MAX_GRAPHS = 8  # distinct widths captured at most (each with one graph per attention span)
DRAFT_HEADROOM = 512  # drafter slots past max_length: a tree's expansions ((depth - 1) * topk keys)


class StaticTarget:
    """A causal LM with a preallocated KV cache and CUDA graphs per forward width (see module doc).

    ``aux_layers``: target ``hidden_states`` indices the drafter reads (its ``config.aux_layers``);
    empty for plain decoding only. ``max_length``: prompt + new tokens + the widest verify of any
    generation run through it. ``cuda_graphs``: capture graphs (CUDA only; ignored elsewhere).
    ``max_graph_width``: wider forwards (a tree's verify is its token budget + 1) run eagerly, and
    markedly slower: keep it above the widest tree verify (benchmarks/results/README.md, quality).
    ``draft_graphs``: ``decode.generate`` drafts through ``proposer(drafter)``, a ``StaticProposer``
    (static drafter cache, CUDA-graphed chain / tree / commit steps) kept next to this storage;
    False drafts with the eager ``Eagle3Proposer`` (the reference path).
    ``length_spans``: attend over the smallest span of ``spans`` holding the context (module doc);
    False attends over the whole storage in every forward (a cost growing with ``max_length``).
    ``prefill_width``: run prompts in chunks of this many tokens, each through its graph (module doc);
    None: ``PREFILL_WIDTH`` with CUDA graphs, else 0 (one eager forward per prompt). Off CUDA a width
    runs the same chunks eagerly (what the CPU tests check).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        aux_layers: Sequence[int] = (),
        max_length: int = 4096,
        cuda_graphs: bool = True,
        max_graph_width: int = MAX_GRAPH_WIDTH,
        draft_graphs: bool = True,
        length_spans: bool = True,
        prefill_width: int | None = None,
    ):
        text = model.config.get_text_config()
        impl = model.config._attn_implementation
        if impl not in MASKABLE_ATTENTION:
            raise ConfigError(
                f"StaticTarget passes a 4D attention mask, which attn_implementation={impl!r} does not take; "
                f"load the target with attn_implementation in {MASKABLE_ATTENTION}"
            )
        layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ConfigError(
                f"StaticTarget supports full-attention decoders only; this target has layer types {sorted(layer_types)}: "
                "use decode.generate with the model itself (DynamicCache)"
            )
        if max_length < 2:
            raise ConfigError(f"max_length={max_length}; give the longest prompt + max_new_tokens + verify width")
        self.model = model
        self.aux_layers = list(aux_layers)
        self._select = HiddenStateSelection(model, self.aux_layers)  # what to ask transformers for (its version's way)
        self.max_length = max_length
        weight = model.get_input_embeddings().weight
        self.device, self.dtype = weight.device, weight.dtype
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.max_graph_width = max_graph_width
        if prefill_width is None:
            prefill_width = min(PREFILL_WIDTH, max_graph_width) if self.cuda_graphs else 0
        if prefill_width < 0 or (self.cuda_graphs and prefill_width > max_graph_width):
            raise ConfigError(f"prefill_width={prefill_width}: give 0 (eager prompts) or a width up to "
                              f"max_graph_width={max_graph_width}")
        self.prefill_width = prefill_width
        self.draft_graphs = draft_graphs
        self._proposers: dict[int, tuple[torch.nn.Module, StaticProposer]] = {}
        layers = text.num_hidden_layers
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.storage = torch.zeros(layers, 2, kv_heads, max_length, head_dim, dtype=self.dtype, device=self.device)
        self._slots = Slots()
        self.spans = attention_spans(max_length) if length_spans else [max_length]
        # One Cache per span: its layers see the first `span` slots of the storage (views, no copies).
        self._caches = {span: Cache(layers=[SlotLayer(self.storage[i, 0, :, :span][None],
                                                      self.storage[i, 1, :, :span][None], self._slots)
                                            for i in range(layers)]) for span in self.spans}
        self.cache = self._caches[max_length]
        self._keys = torch.arange(max_length, device=self.device)  # [S]
        self._cache_kwarg, self._takes_cache_position = cache_api(model)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], tuple]] = {}
        self.captured: list[int] = []  # widths with a graph, in capture order
        self.graph_keys: list[tuple[int, int]] = []  # (width, span) of every graph, in capture order
        self._owner: StaticRunner | None = None

    def runner(self, aux_layers: Sequence[int] = ()) -> StaticRunner:
        """A fresh generation over this target (the storage is reused, its old content masked out).

        ``aux_layers``: the drafter's (exactly the ones this StaticTarget captures), or none for
        plain decoding.
        """
        if aux_layers and list(aux_layers) != self.aux_layers:
            raise ConfigError(
                f"the drafter reads target hidden_states {list(aux_layers)}, this StaticTarget captures "
                f"{self.aux_layers}; build it with aux_layers={list(aux_layers)}"
            )
        runner = StaticRunner(self, with_aux=bool(aux_layers))
        self._owner = runner  # one generation at a time: it owns the storage
        return runner

    def proposer(self, drafter: Eagle3Drafter) -> StaticProposer:
        """The ``StaticProposer`` of ``drafter`` (prepared for this target), built on first use and
        kept with its graphs: one per drafter, reused by every generation."""
        held = self._proposers.get(id(drafter))
        if held is None or held[0] is not drafter:
            held = self._proposers[id(drafter)] = (
                drafter, StaticProposer(drafter, self.max_length + DRAFT_HEADROOM, cuda_graphs=self.cuda_graphs,
                                        prompt_width=self.prefill_width))
        return held[1]

    # -- the forward, shared by eager calls and graph capture ---------------------------------
    def _run(self, ids, past, depth, tree, span: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [W], past [] long, depth [W] long, tree [W, W] bool -> (logits [W, V] fp32, aux [W, A*Ht]),
        attending over the first ``span`` slots (one of ``spans``; None: all of them)."""
        w = ids.shape[0]
        span = self.max_length if span is None else span
        self._slots.pos = past + torch.arange(w, device=self.device)  # [W] slots of the new keys
        rel = self._keys[None, :span] - past  # [1, S] key slot relative to the first new token
        inside = (rel >= 0) & (rel < w)
        ancestor = tree.gather(1, rel.clamp(0, w - 1).expand(w, -1))  # [W, S]
        visible = (rel < 0) | (inside & ancestor)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[None, None]  # [1, 1, W, S]
        extra = {"cache_position": self._slots.pos} if self._takes_cache_position else {}
        out = self.model(
            input_ids=ids[None],
            position_ids=(past + depth)[None],
            attention_mask=mask,
            use_cache=True,
            output_hidden_states=self._select.request,
            **{self._cache_kwarg: self._caches[span]},
            **extra,
        )
        aux = torch.cat([h[0] for h in self._select.take(out.hidden_states)], -1) if self.aux_layers else None
        return out.logits[0].float(), aux

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, past: int, depth: torch.Tensor, tree: torch.Tensor,
                causal: bool = False) -> TargetOut:
        """One forward of the new tokens ``ids`` after ``past`` committed ones over the span that
        holds them. A prompt (past = 0; ``causal``: depth and tree are the plain causal ones) runs in
        chunks of ``prefill_width`` (``_prefill``) or else eagerly; every later width through its graph."""
        w = ids.shape[0]
        if past + w > self.max_length:
            raise ConfigError(
                f"this generation needs {past + w} cache slots, the StaticTarget holds max_length={self.max_length}; "
                "build it with a larger max_length or ask for fewer tokens"
            )
        if past == 0 and causal:
            out = self._prefill(ids)
            if out is not None:
                return out
        span = self.span(past + w)
        graph = self._graph(w, span) if past > 0 else None  # a prompt's length varies: no graph for it
        if graph is None:
            # An eager forward has a shape of its own (a prompt's length): without cuDNN, which builds an
            # execution plan per new shape (~30 ms of host time on an H200), paid by whichever decoding
            # mode meets a prompt length first. Graph replays keep torch's choice.
            with sdpa_for_growing_keys(self.device):
                logits, aux = self._run(ids, torch.tensor(past, device=self.device), depth, tree, span)
            return TargetOut(logits, aux)
        g, buf, (logits, aux) = graph
        buf["ids"].copy_(ids, non_blocking=True)
        buf["past"].fill_(past)
        buf["depth"].copy_(depth, non_blocking=True)
        buf["tree"].copy_(tree, non_blocking=True)
        g.replay()
        # Copies: the next replay overwrites the graph's outputs.
        return TargetOut(logits.clone(), None if aux is None else aux.clone())

    def _prefill(self, ids: torch.Tensor) -> TargetOut | None:
        """The prompt ``ids`` as forwards of ``prefill_width`` tokens (the last one padded), each
        through its graph or, without graphs, eagerly; None where it cannot (no width, or the padded
        prompt over ``max_length``): the caller runs one eager forward."""
        c, n = self.prefill_width, ids.shape[0]
        chunks = -(-n // c) if c else 0
        if not chunks or chunks * c > self.max_length:
            return None
        dev = self.device
        depth = torch.arange(c, device=dev)
        tree = torch.ones(c, c, dtype=torch.bool, device=dev).tril()
        logits, aux = [], []
        for k in range(chunks):
            lo, m = k * c, min(c, n - k * c)
            chunk = torch.zeros(c, dtype=ids.dtype, device=dev)
            chunk[:m] = ids[lo:lo + m]
            span = self.span(lo + c)
            graph = self._graph(c, span)
            if graph is None:
                with sdpa_for_growing_keys(dev):
                    out_logits, out_aux = self._run(chunk, torch.tensor(lo, device=dev), depth, tree, span)
            else:
                g, buf, (out_logits, out_aux) = graph
                buf["ids"].copy_(chunk)
                buf["past"].fill_(lo)
                buf["depth"].copy_(depth)  # a verify of the same width may have left a tree's
                buf["tree"].copy_(tree)
                g.replay()
            logits.append(out_logits[:m].clone())  # copies: the next replay overwrites the outputs
            if out_aux is not None:
                aux.append(out_aux[:m].clone())
        return TargetOut(torch.cat(logits), torch.cat(aux) if aux else None)

    def span(self, n: int) -> int:
        """The attention span of a forward whose committed + new tokens are ``n``: the smallest of
        ``spans`` holding them."""
        return span_for(self.spans, n)

    @torch.inference_mode()
    def capture_spans(self) -> list[tuple[int, int]]:
        """Capture the graph of every span for every width captured so far, and the same for the
        drafter steps of every proposer (call it after a warm-up generation per mode, so no capture
        lands in a timed one); returns the target's new keys."""
        before = len(self.graph_keys)
        for w in list(self.captured):
            for span in self.spans:
                if span >= w:
                    self._graph(w, span)
        for _, proposer in self._proposers.values():
            proposer.capture_spans()
        return self.graph_keys[before:]

    def _graph(self, w: int, span: int):
        if not self.cuda_graphs or w > self.max_graph_width:
            return None
        if (w, span) not in self._graphs and (w in self.captured or len(self.captured) < MAX_GRAPHS):
            self._graphs[w, span] = self._capture(w, span)
            if w not in self.captured:
                self.captured.append(w)
            self.graph_keys.append((w, span))
        return self._graphs.get((w, span))

    def _capture(self, w: int, span: int):
        dev = self.device
        lo = span - w
        buf = {
            "ids": torch.zeros(w, dtype=torch.long, device=dev),
            # Warm-up and capture write their keys into the span's last w slots; what a generation
            # has there is saved and put back, so a capture at any time changes nothing.
            "past": torch.tensor(lo, device=dev),
            "depth": torch.arange(w, device=dev),
            "tree": torch.ones(w, w, dtype=torch.bool, device=dev).tril(),
        }
        saved = self.storage[..., lo:span, :].clone()
        try:
            graph, out = capture_graph(lambda **kw: self._run(**kw, span=span), buf, dev)
        finally:
            self.storage[..., lo:span, :].copy_(saved)
        return graph, buf, out

    @torch.inference_mode()
    def move(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy the keys/values at slots ``src`` [n] to ``dst_start .. dst_start + n - 1``, every layer."""
        dst = torch.arange(dst_start, dst_start + src.shape[0], device=self.device)
        self.storage.index_copy_(3, dst, self.storage.index_select(3, src.to(self.device)))


class StaticRunner:
    """One generation's view of a ``StaticTarget``: the ``TargetRunner`` interface, rollback by length."""

    def __init__(self, target: StaticTarget, with_aux: bool):
        self.target = target
        self.device = target.device
        self._length = 0
        self._with_aux = with_aux

    @property
    def length(self) -> int:
        return self._length

    def forward(
        self,
        ids: torch.Tensor,  # [T] long
        positions: torch.Tensor | None = None,  # [T]; default: right after the cache
        mask: torch.Tensor | None = None,  # [T, T] bool among the new tokens, True = attend; None = causal
    ) -> TargetOut:
        if self.target._owner is not self:
            raise RuntimeError(
                "another generation started on this StaticTarget and overwrote its KV storage; run one "
                "generation at a time per StaticTarget (build one per thread)"
            )
        t, past = ids.shape[0], self._length
        dev = self.device
        depth = torch.arange(t, device=dev) if positions is None else positions.to(dev) - past
        tree = torch.ones(t, t, dtype=torch.bool, device=dev).tril() if mask is None else mask.to(dev)
        out = self.target.forward(ids.to(dev), past, depth, tree, causal=positions is None and mask is None)
        self._length = past + t
        return out if self._with_aux else TargetOut(out.logits, None)

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions; the rest stay in the storage, masked, until overwritten."""
        self._length = min(self._length, n)

    def keep_path(self, past: int, path: Sequence[int], on_device: torch.Tensor | None = None) -> None:
        """Keep the first ``past`` positions, then the new tokens at offsets ``path`` (a tree's accepted
        path). ``on_device``: the same offsets on the device; a copy in from the host would wait for
        the work queued on the device (a draft in flight) to finish."""
        if list(path) != list(range(len(path))):
            self.target.move(past + (torch.tensor(list(path)) if on_device is None else on_device), past)
        self._length = past + len(path)
