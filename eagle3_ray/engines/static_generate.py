"""Batched generation on a preallocated KV cache, the decode step replayed as one CUDA graph.

Self-distillation asks the target for thousands of answers. transformers' ``generate`` on its
DynamicCache launches every kernel of every step from Python and grows each layer's cache by
concatenation; for a small target on a GPU that is launch-bound (benchmarks/results/README.md,
``batch_generate_*``). ``StaticBatchGenerator`` does the same greedy or sampled
decoding with

- one KV storage ``[L, 2, B, kv_heads, S, head_dim]`` per group of prompts, left-padded so every
  row writes its next key at the same slot (``S`` rounded up to ``GRAIN``, so batches of similar
  length share one storage and one graph). Every decode step attends over all ``S`` slots of every
  row, so one long prompt in a batch of short ones would make each row's step as dear as the
  long one's: a call's prompts are split by length into groups where that saves decode work
  (``plan_groups``), and the storages and graphs of the last few shapes are kept for the next calls
  (a multi-turn batch alternates between its turns' shapes);
- a prompt forward per row chunk (eager; only the last position's logits are computed);
- a decode step whose every input lives in device buffers it updates itself (token, slot, output
  column, finished rows): captured once per shape as a CUDA graph and replayed with no host work
  but one ``done.all()`` check every ``sync_every`` steps.

Sampling (temperature / top-p, top-k off, no repetition penalty: the knobs self-distillation sets
on ``generate``) is a Gumbel-max draw inside the graph from the default generator, seeded per call.
Greedy decoding produces the same tokens as ``generate`` (tested in fp32 on CPU, where the same
step function runs eagerly).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from eagle3_ray.engines.base import check_generate_args, cut_at_eos
from eagle3_ray.engines.static_cache import MASKABLE_ATTENTION, SlotLayer, Slots, cache_api
from eagle3_ray.errors import EngineError

GRAIN = 256  # storage lengths are rounded up to a multiple of this
# What one decode step costs besides attention, in KV slots of one row (the unit of the attention's
# cost: one row attending over one slot): launches, weights, logits and sampling of a step. On the
# H200 with SmolLM2-135M a step cost about as much as attention over ~200k row-slots
# (benchmarks/results/batch_generate_smollm2_h200.json: 64 vs 512 rows at S=768); a lower value
# splits more eagerly. It only decides where a call's prompts are split (plan_groups).
STEP_OVERHEAD_SLOTS = 1 << 17
KEEP_SHAPES = 4  # batch shapes (storage + graph) kept across calls
PREFILL_TOKENS = 32768  # padded prompt tokens per prompt forward (bounds its activations)
DECODE_ATTENTION = "eagle3_decode_sdpa"  # registered with transformers' AttentionInterface below


def _decode_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa for one new token per row with grouped-query heads and a 4D mask, without ``repeat_kv``.

    transformers' sdpa (before 5.24) copies every key/value head ``num_key_value_groups`` times when a
    mask is given: at batch 512 that copy, not the attention, was most of a decode step. Here the
    query heads of one key/value head are laid out along the query axis instead, so each key and
    value is read once: [B, H, 1, D] -> [B, KV, G, D] against [B, KV, S, D], the mask [B, 1, 1, S]
    broadcast over G. Anything else (prompts, no grouping) goes to transformers' sdpa.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, h, q, d = query.shape
    if q != 1 or groups == 1 or attention_mask is None or attention_mask.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    packed = query.reshape(b, h // groups, groups, d)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask.to(query.dtype), scale=scaling
    )  # [B, KV, G, D]
    return out.reshape(b, 1, h, d), None  # transformers' layout: [B, q, H, D]


def _register_decode_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, _decode_sdpa)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``StaticBatchGenerator`` cannot drive ``model`` (None = it can)."""
    impl = model.config._attn_implementation
    if impl not in MASKABLE_ATTENTION:
        return f"attn_implementation={impl!r} takes no 4D mask (need one of {MASKABLE_ATTENTION})"
    text = model.config.get_text_config()
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer types {sorted(types)}: only full-attention decoders"
    if getattr(text, "kv_lora_rank", None) or getattr(text, "v_head_dim", None):
        return "multi-head latent attention (keys and values of different head dims)"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no logits_to_keep"
    return None


@dataclass
class _Batch:
    """Device state of one batch shape; the decode step reads and updates it in place."""

    key: tuple
    storage: torch.Tensor  # [L, 2, B, kv, S, D]
    cache: Cache
    tok: torch.Tensor  # [B] last token of each row
    pad: torch.Tensor  # [B] left-padding of each row
    cur: torch.Tensor  # [1] slot the next token's key goes to
    col: torch.Tensor  # [1] output column of the token being produced
    done: torch.Tensor  # [B] bool, row has produced an EOS
    out: torch.Tensor  # [B, max_new] produced tokens (pad after EOS)
    graph: torch.cuda.CUDAGraph | None = None


class StaticBatchGenerator:
    """Greedy / sampled batched generation for one model (see the module doc).

    Reuse one instance across calls: the storage and graph of the last batch shape are kept.
    ``cuda_graphs``: capture the decode step (CUDA only; elsewhere it runs eagerly).
    ``kv_budget_bytes``: KV storage one batch may take; prompts are grouped (longest first) to fit.
    Default: 60% of the device's free plus cached memory on CUDA, unbounded elsewhere.
    ``step_overhead_slots``: a decode step's fixed cost in row-slots of attention (``plan_groups``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_ids: Sequence[int],
        pad_id: int,
        cuda_graphs: bool = True,
        sync_every: int = 16,
        kv_budget_bytes: int | None = None,
        step_overhead_slots: int = STEP_OVERHEAD_SLOTS,
    ):
        reason = unsupported_reason(model)
        if reason:
            raise EngineError(f"StaticBatchGenerator cannot drive this model: {reason}; use model.generate")
        self.model = model
        text = model.config.get_text_config()
        self.layers = text.num_hidden_layers
        self.kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        weight = model.get_input_embeddings().weight
        self.device, self.dtype = weight.device, weight.dtype
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.sync_every = max(1, sync_every)
        self.kv_budget_bytes = kv_budget_bytes  # None: 60% of what the device can spare (CUDA), else unbounded
        self.step_overhead_slots = step_overhead_slots
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        self.pad_id = pad_id
        self._cache_kwarg, self._takes_cache_position = cache_api(model)
        self._slots = Slots()
        _register_decode_attention()
        self._batches: OrderedDict[tuple, _Batch] = OrderedDict()  # kept shapes, least recently used first
        self.builds = 0  # batch states (storage + buffers) built so far
        self.captures = 0  # graphs captured so far (a new batch shape or sampling mode captures one)

    def kv_bytes(self, batch: int, length: int) -> int:
        return self.layers * 2 * batch * self.kv_heads * _round_up(length, GRAIN) * self.head_dim * self.dtype.itemsize

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> list[list[int]]:
        """New tokens of each prompt, up to and including its first EOS (at most ``max_new_tokens``).
        Sampling draws from torch's default generator of the model's device: seed it before."""
        if not prompts:
            return []
        check_generate_args(max_new_tokens, temperature, top_p)
        empty = [i for i, p in enumerate(prompts) if len(p) == 0]
        if empty:
            raise EngineError(f"generate: prompts {empty} are empty; need non-empty prompts (one token at least)")
        out: list[list[int] | None] = [None] * len(prompts)
        for group in self._groups([len(p) for p in prompts], max_new_tokens):
            for i, row in zip(group, self._generate([prompts[i] for i in group], max_new_tokens, temperature, top_p)):
                out[i] = row
        return out

    def _groups(self, lengths: list[int], max_new: int) -> list[list[int]]:
        """Prompt indices, longest first, in groups of similar length (``plan_groups``), each cut
        further where its KV storage would not fit the device's free memory."""
        budget = self._kv_budget()
        groups: list[list[int]] = []
        for planned in plan_groups(lengths, max_new, self.step_overhead_slots):
            start = len(groups)
            for i in planned:
                if len(groups) > start and (len(groups[-1]) + 1) * self.kv_bytes(1, lengths[groups[-1][0]] + max_new) <= budget:
                    groups[-1].append(i)
                elif self.kv_bytes(1, lengths[i] + max_new) > budget:
                    raise EngineError(
                        f"a prompt of {lengths[i]} tokens + max_new_tokens={max_new} needs a "
                        f"{self.kv_bytes(1, lengths[i] + max_new) / 2**30:.1f} GiB KV cache, more than the "
                        f"{budget / 2**30:.1f} GiB this device can spare: shorten the prompt or max_new_tokens"
                    )
                else:
                    groups.append([i])
        return groups

    def _kv_budget(self) -> float:
        """Bytes of KV storage one group may take: ``kv_budget_bytes``, else on CUDA 60% of the free
        and cached memory plus what the kept storages hold (they are freed for a shape that needs it)."""
        if self.kv_budget_bytes is not None:
            return self.kv_budget_bytes
        if self.device.type != "cuda":
            return float("inf")
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return 0.6 * (free + cached + self._kept_bytes())

    def _kept_bytes(self) -> int:
        return sum(b.storage.numel() * self.dtype.itemsize for b in self._batches.values())

    def _generate(self, prompts, max_new_tokens: int, temperature: float, top_p: float) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        b = self._buffers(len(prompts), width + max_new_tokens, max_new_tokens, temperature, top_p)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        pad = torch.empty(len(prompts), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            pad[row] = width - len(p)
        b.pad.copy_(pad)
        b.done.zero_()
        b.out.fill_(self.pad_id)
        first = self._prefill(b, ids.to(self.device), width, temperature, top_p)
        self._emit(b, first, torch.zeros(1, dtype=torch.long, device=self.device))
        b.cur.fill_(width)
        b.col.fill_(1)
        produced = 1
        while produced < max_new_tokens:
            if produced % self.sync_every == 0 and bool(b.done.all()):
                break
            if self.cuda_graphs:
                if b.graph is None:
                    b.graph = self._capture(b, temperature, top_p)
                b.graph.replay()
            else:
                self._step(b, temperature, top_p)
            produced += 1
        eos = set(self.eos.tolist())
        return [cut_at_eos(r, eos) for r in b.out[:, :produced].tolist()]

    # -- state ----------------------------------------------------------------------------------
    def _buffers(self, rows: int, length: int, max_new: int, temperature: float, top_p: float) -> _Batch:
        """The state of this batch shape: a kept one (its graph too), else a new one; the least
        recently used shapes are dropped beyond ``KEEP_SHAPES`` or where the new storage needs room."""
        s = _round_up(length, GRAIN)
        key = (rows, s, _round_up(max_new, GRAIN), temperature, top_p)
        if key in self._batches:
            self._batches.move_to_end(key)
            return self._batches[key]
        need = self.kv_bytes(rows, s)
        budget = self._kv_budget()
        while self._batches and (len(self._batches) >= KEEP_SHAPES or self._kept_bytes() + need > budget):
            self._batches.popitem(last=False)  # free older shapes' storage and graph first
        dev = self.device
        storage = torch.zeros(self.layers, 2, rows, self.kv_heads, s, self.head_dim, dtype=self.dtype, device=dev)
        cache = Cache(layers=[SlotLayer(storage[i, 0], storage[i, 1], self._slots) for i in range(self.layers)])
        batch = _Batch(
            key=key, storage=storage, cache=cache,
            tok=torch.zeros(rows, dtype=torch.long, device=dev),
            pad=torch.zeros(rows, dtype=torch.long, device=dev),
            cur=torch.zeros(1, dtype=torch.long, device=dev),
            col=torch.zeros(1, dtype=torch.long, device=dev),
            done=torch.zeros(rows, dtype=torch.bool, device=dev),
            out=torch.zeros(rows, _round_up(max_new, GRAIN), dtype=torch.long, device=dev),
        )
        self._batches[key] = batch
        self.builds += 1
        return batch

    @property
    def _batch(self) -> _Batch | None:
        """The most recently used shape's state."""
        return next(reversed(self._batches.values())) if self._batches else None

    # -- forwards -------------------------------------------------------------------------------
    def _forward(self, cache: Cache, ids, positions, slots, mask) -> torch.Tensor:
        """Last-position logits [rows, V] (fp32) of ids [rows, W] written at ``slots`` [W]."""
        self._slots.pos = slots
        extra = {"cache_position": slots} if self._takes_cache_position else {}
        config = self.model.config
        impl = config._attn_implementation
        if ids.shape[1] == 1 and impl == "sdpa":  # decode: grouped heads without repeat_kv (see _decode_sdpa)
            config._attn_implementation = DECODE_ATTENTION
        try:
            out = self.model(
                input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, logits_to_keep=1,
                **{self._cache_kwarg: cache}, **extra,
            )
        finally:
            config._attn_implementation = impl
        return out.logits[:, -1].float()

    def _prefill(self, b: _Batch, ids: torch.Tensor, width: int, temperature: float, top_p: float) -> torch.Tensor:
        """The prompts' keys into slots 0..width-1 (eager, in row chunks); returns each row's first token."""
        rows, s = ids.shape[0], b.storage.shape[4]
        q = torch.arange(width, device=self.device)
        keys = torch.arange(s, device=self.device)
        chunk = max(1, PREFILL_TOKENS // width)
        firsts = []
        for r0 in range(0, rows, chunk):
            r1 = min(rows, r0 + chunk)
            cache = Cache(layers=[SlotLayer(b.storage[i, 0, r0:r1], b.storage[i, 1, r0:r1], self._slots)
                                  for i in range(self.layers)])
            pad = b.pad[r0:r1, None, None]  # [r, 1, 1]
            # Row r's query q sees keys pad..q; a padding query sees only itself (its output is unused).
            visible = (keys[None, None] <= q[None, :, None]) & (
                (keys[None, None] >= pad) | (keys[None, None] == q[None, :, None])
            )  # [r, W, S]
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[:, None]
            positions = (q[None] - b.pad[r0:r1, None]).clamp(min=0)
            logits = self._forward(cache, ids[r0:r1], positions, q, mask)
            firsts.append(self._pick(logits, temperature, top_p))
        return torch.cat(firsts)

    def _step(self, b: _Batch, temperature: float, top_p: float) -> None:
        """One decode step of every row, entirely on device buffers (graph-safe: no host reads)."""
        keys = torch.arange(b.storage.shape[4], device=self.device)
        visible = (keys[None] >= b.pad[:, None]) & (keys[None] <= b.cur)  # [B, S]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[:, None, None]  # [B, 1, 1, S]
        positions = (b.cur - b.pad)[:, None]  # [B, 1]
        logits = self._forward(b.cache, b.tok[:, None], positions, b.cur, mask)
        self._emit(b, self._pick(logits, temperature, top_p), b.col)
        b.cur.add_(1)
        b.col.add_(1)

    def _emit(self, b: _Batch, nxt: torch.Tensor, col: torch.Tensor) -> None:
        nxt = torch.where(b.done, self.pad_id, nxt)
        b.out.index_copy_(1, col, nxt[:, None])
        b.done.logical_or_(torch.isin(nxt, self.eos))
        b.tok.copy_(nxt)

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        """Greedy argmax, or a temperature / top-p sample by Gumbel-max (graph-safe RNG)."""
        if temperature == 0:
            return logits.argmax(-1)
        logits = logits / temperature
        if top_p < 1:
            sorted_logits, order = logits.sort(-1, descending=True)
            probs = sorted_logits.softmax(-1)
            before = probs.cumsum(-1) - probs  # mass of the more likely tokens
            sorted_logits = sorted_logits.masked_fill(before > top_p, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        u = torch.rand_like(logits).clamp_(min=torch.finfo(logits.dtype).tiny)
        return (logits - torch.log(-torch.log(u))).argmax(-1)

    def _capture(self, b: _Batch, temperature: float, top_p: float) -> torch.cuda.CUDAGraph:
        """Capture the decode step on the current state; the warm-up steps' effects are undone."""
        saved = [t.clone() for t in (b.tok, b.cur, b.col, b.done)]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy inits and workspaces outside the capture
                self._step(b, temperature, top_p)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # The warm-ups wrote keys past `cur` and outputs past `col`: both are rewritten before read.
        for t, v in zip((b.tok, b.cur, b.col, b.done), saved):
            t.copy_(v)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(b, temperature, top_p)
        self.captures += 1
        return graph


def plan_groups(lengths: Sequence[int], max_new: int, step_overhead: int = STEP_OVERHEAD_SLOTS) -> list[list[int]]:
    """Prompt indices, longest first, split into runs that share one KV storage length.

    A run of ``r`` prompts whose longest one needs a storage of ``S`` slots costs about
    ``max_new * (r * S + step_overhead)``: each decode step attends over all ``S`` slots of every
    row, plus the step's fixed cost. Returns the split that minimises the sum (exact dynamic
    programme over the distinct storage lengths; splitting where the length does not change never
    pays): a few very long prompts get groups of their own instead of widening every row's storage,
    prompts of similar lengths stay in one batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    levels: list[list[int]] = []  # [storage length, start, end) over `order`, longest first
    for pos, i in enumerate(order):
        s = _round_up(lengths[i] + max_new, GRAIN)
        if levels and levels[-1][0] == s:
            levels[-1][2] = pos + 1
        else:
            levels.append([s, pos, pos + 1])
    k = len(levels)
    best, cut = [0.0] * (k + 1), [k] * (k + 1)  # best[j]: least cost of levels j.., first run j..cut[j]
    for j in range(k - 1, -1, -1):
        s, start = levels[j][0], levels[j][1]
        best[j] = float("inf")
        for e in range(j + 1, k + 1):
            cost = (levels[e - 1][2] - start) * s + step_overhead + best[e]
            if cost < best[j]:
                best[j], cut[j] = cost, e
    groups, j = [], 0
    while j < k:
        groups.append(order[levels[j][1] : levels[cut[j] - 1][2]])
        j = cut[j]
    return groups


def _round_up(n: int, grain: int) -> int:
    return -(-n // grain) * grain

