"""Hugging Face transformers target engine: hidden-state capture and batched generation. No Ray in here.

Capture runs the base model (``model.model``), never the CausalLM wrapper, so no [B, T, vocab]
logits are built, and asks transformers for only the three aux ``hidden_states`` it needs. With an
audit share, the target's lm_head is applied to that share of the captured rows, on the device, for
the capture audit (audit/rows.py).
"""

from __future__ import annotations

import gc
import logging
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from eagle3_ray.audit.rows import RowFigures, audit_positions, normed_rms, row_figures
from eagle3_ray.audit.weights import final_norm
from eagle3_ray.config import TargetConfig
from eagle3_ray.engines.base import Capture, EngineInfo, check_generate_args, cut_at_eos, resolve_aux_layers
from eagle3_ray.engines.hidden_states import HiddenStateSelection
from eagle3_ray.engines.targets import LoadedTarget, load_target, target_fingerprint
from eagle3_ray.errors import EngineError

logger = logging.getLogger(__name__)


def right_padded(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention mask, both long [B, Tmax], of right-padded 1-D id tensors."""
    input_ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, s in enumerate(seqs):
        input_ids[row, : len(s)] = s
        mask[row, : len(s)] = 1
    return input_ids, mask


def plan_groups(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices of sequences grouped into forwards, longest first.

    A group is padded to its first (longest) member, so its cost is ``len(group) * lengths[group[0]]``,
    kept <= ``batch_tokens``; a sequence longer than the budget runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep input order
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors``. From CUDA they land in pinned memory and are only enqueued on the
    current stream: read them after that stream is synchronised, and keep the sources alive until then.

    Pinned copies run an order of magnitude faster than pageable ones into fresh pages
    (benchmarks/results/README.md, extraction); torch's caching host allocator hands freed pinned blocks back out, so in steady state nothing is allocated.
    """
    if tensors[0].device.type != "cuda":
        return [t.to("cpu", copy=True) for t in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    return host


class HFEngine:
    """``TargetEngine`` on a transformers causal LM (Llama, Qwen2, DeepSeek-V3, ... with ``model.model``)."""

    def __init__(self, target_cfg: TargetConfig, batch_tokens: int = 8192, device: str | torch.device | None = None,
                 audit_share: float = 0.0):
        """``audit_share``: the share of each sequence's rows whose audit figures ``capture`` computes."""
        if batch_tokens < 1:
            raise EngineError(f"batch_tokens={batch_tokens}: the forward token budget must be >= 1")
        self.batch_tokens = batch_tokens
        self.target: LoadedTarget = load_target(target_cfg, device)
        model = self.target.model
        if not isinstance(getattr(model, "model", None), torch.nn.Module):
            raise EngineError(
                f"target.model={target_cfg.model!r} ({type(model).__name__}) has no base model at `.model`; "
                "the HF engine supports decoder-only *ForCausalLM models (Llama, Qwen2, DeepSeek-V3, ...)"
            )
        text_cfg = model.config.get_text_config()
        num_layers = text_cfg.num_hidden_layers
        self.info = EngineInfo(
            model_type=model.config.model_type,
            num_layers=num_layers,
            hidden_size=text_cfg.hidden_size,
            vocab_size=model.get_input_embeddings().num_embeddings,
            aux_layers=resolve_aux_layers(target_cfg.aux_layers, num_layers),
            dtype=str(self.target.dtype).removeprefix("torch."),
            fingerprint=target_fingerprint(model),
            extra={"backend": "hf", "spec": target_cfg.model, "kind": self.target.resolved.kind,
                   "device": str(self.target.device)},
        )
        # What to ask the base model for, the way its transformers reads a list (engines/hidden_states.py).
        self._select = HiddenStateSelection(model.model, self.info.aux_layers)
        tok = self.target.tokenizer
        gen_eos = model.generation_config.eos_token_id
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        self.eos_ids: set[int] = {tok.eos_token_id, *gen_eos} - {None}
        if not self.eos_ids:
            raise EngineError(f"target.model={target_cfg.model!r} defines no EOS token; generation could not stop")
        self.pad_id: int = tok.pad_token_id if tok.pad_token_id is not None else min(self.eos_ids)
        self.audit_share = audit_share
        self._thread = threading.local()  # each calling thread's capture stream
        # generate(): on CUDA a static-cache, CUDA-graphed decoder where the model allows one
        # (engines/static_generate.py); elsewhere transformers' generate. Tests may flip it.
        self.static_generate: bool = self.target.device.type == "cuda"
        self._static_gen = None

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def _as_ids(self, seq: Sequence[int], what: str) -> torch.Tensor:
        ids = torch.as_tensor(seq, dtype=torch.long)  # [T]
        if ids.ndim != 1 or ids.numel() == 0:
            raise EngineError(f"{what}: expected a non-empty 1-D token id sequence, got shape {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.info.vocab_size:
            raise EngineError(
                f"{what}: token ids must lie in [0, {self.info.vocab_size}) for this target, got "
                f"[{int(ids.min())}, {int(ids.max())}]; tokenize with the target's tokenizer"
            )
        return ids

    @torch.inference_mode()
    def capture(self, batch: Sequence[Sequence[int]]) -> list[Capture]:
        seqs = [self._as_ids(s, f"capture sequence {i}") for i, s in enumerate(batch)]
        out: list[Capture | None] = [None] * len(seqs)
        for group in plan_groups([len(s) for s in seqs], self.batch_tokens):
            for i, cap in zip(group, self._forward([seqs[i] for i in group])):
                out[i] = cap
        return out

    def _forward(self, seqs: list[torch.Tensor]) -> list[Capture]:
        """One right-padded forward; right padding keeps every row's positions at 0..T-1."""
        lengths = [len(s) for s in seqs]
        input_ids, mask = right_padded(seqs)
        with self.capture_stream():
            aux_dev, last_dev = self.forward_states(input_ids, mask)  # [B, Tmax, 3H], [B, Tmax, H]
            # One bulk copy per tensor (per-row copies cost a sync each); rows are views of it.
            # aux_dev/last_dev stay referenced until the stream is synchronised on leaving the block.
            aux, last = to_host([aux_dev, last_dev])
            audits = self._audit(input_ids, lengths, last_dev)  # queued after the copies
            norm = final_norm(self.target.model)
            normed = None if norm is None else normed_rms(last_dev.flatten(0, 1), norm.weight).view(last_dev.shape[:2])
        audits = [a.to("cpu") if a is not None else None for a in audits]
        normed = normed.cpu() if normed is not None else None  # [B, Tmax]
        return [Capture(aux[row, :n], last[row, :n], audits[row], normed[row, :n] if normed is not None else None)
                for row, n in enumerate(lengths)]

    def _audit(self, input_ids: torch.Tensor, lengths: list[int], last_dev: torch.Tensor) -> list[RowFigures | None]:
        """The audit figures of each row's ``audit_positions``, with the target's lm_head, on the device
        of ``last_dev`` [B, Tmax, H]; one call over the whole group's rows."""
        if self.audit_share <= 0:
            return [None] * len(lengths)
        positions = [audit_positions(n, self.audit_share) for n in lengths]
        rows = torch.cat([torch.full_like(p, b) for b, p in enumerate(positions)])  # [n] batch row
        cols = torch.cat(positions)  # [n] position in that row
        dev = last_dev.device
        weight = self.target.model.get_output_embeddings().weight  # [V, H]
        fig = row_figures(last_dev[rows.to(dev), cols.to(dev)], weight, input_ids[rows, cols + 1], cols)
        counts = [len(p) for p in positions]
        parts = [torch.split(t, counts) for t in (fig.positions, fig.nll, fig.entropy, fig.argmax)]
        return [RowFigures(*fields) for fields in zip(*parts)]

    def forward_states(self, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """aux [B, T, 3H] and last [B, T, H] (post final norm = lm_head input) on the target device."""
        dev = self.target.device
        out = self.target.model.model(
            input_ids=input_ids.to(dev),
            attention_mask=mask.to(dev),
            output_hidden_states=self._select.request,  # only these states are kept
            use_cache=False,
        )
        aux = torch.cat(self._select.take(out.hidden_states), dim=-1)  # [B, T, 3H]
        return aux, out.last_hidden_state

    @torch.inference_mode()
    def aux_layer_sources(self, seq: Sequence[int]) -> list[int]:
        """A reference capture of ``seq``: for each aux block of ``capture([seq])``, the index k of
        transformers' full ``hidden_states`` tuple (every layer, ``output_hidden_states=True``) it is
        nearest to. Equals ``info.aux_layers`` when the capture takes the states its ids name."""
        ids = self._as_ids(seq, "reference sequence")
        aux = self.capture([ids.tolist()])[0].aux_hidden.float()  # [T, 3H]
        out = self.target.model.model(input_ids=ids[None].to(self.target.device), output_hidden_states=True,
                                      use_cache=False)
        states = [h[0].float().cpu() for h in out.hidden_states]  # L + 1 of [T, H]
        found = []
        for block in aux.split(self.info.hidden_size, dim=-1):
            gaps = [float((block - s).norm() / s.norm().clamp_min(1e-12)) for s in states]
            found.append(min(range(len(gaps)), key=gaps.__getitem__))
        return found

    @contextmanager
    def capture_stream(self) -> Iterator[None]:
        """Run the block on the calling thread's own CUDA stream and wait for that stream on exit.

        Ray Data runs several capture calls of one actor in threads: on the shared default stream
        their forwards and copies would queue behind each other; on a stream each, one call's
        copy overlaps another's forward. A no-op off CUDA.
        """
        dev = self.target.device
        if dev.type != "cuda":
            yield
            return
        stream = getattr(self._thread, "stream", None)
        if stream is None:
            stream = self._thread.stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))  # whatever the default stream still owes (weights)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()  # blocks this thread only; the GIL is released while waiting

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[list[int]]:
        check_generate_args(max_new_tokens, temperature, top_p)
        seqs = [self._as_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        if not seqs:
            return []
        dev = self.target.device
        rng_devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        # A private RNG stream: the same seed gives the same samples, and callers' RNG state is untouched.
        with torch.random.fork_rng(devices=rng_devices, device_type=dev.type):
            torch.manual_seed(seed)
            static = self._static_generator()
            if static is not None:
                return static.generate([s.tolist() for s in seqs], max_new_tokens, temperature, top_p)
            return self._hf_generate(seqs, max_new_tokens, temperature, top_p)

    def _hf_generate(self, seqs: list[torch.Tensor], max_new_tokens: int, temperature: float, top_p: float):
        """transformers' ``generate`` on a left-padded batch (the caller seeds the RNG)."""
        from transformers import GenerationConfig

        width = max(len(s) for s in seqs)
        # Left padding: every row's next token is then produced at the same column.
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)  # [B, Tmax]
        mask = torch.zeros_like(input_ids)  # [B, Tmax]
        for row, s in enumerate(seqs):
            input_ids[row, width - len(s):] = s
            mask[row, width - len(s):] = 1
        # Knobs left None are filled from the checkpoint's generation_config (top_k=50,
        # repetition_penalty, ...), which would skew self-distilled answers: set them all.
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": 0} if temperature > 0 else {}
        gen_cfg = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            repetition_penalty=1.0,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            **sampling,
        )
        dev = self.target.device
        out = self.target.model.generate(
            input_ids=input_ids.to(dev), attention_mask=mask.to(dev), generation_config=gen_cfg
        )  # [B, Tmax + new]
        return [cut_at_eos(row, self.eos_ids) for row in out[:, width:].tolist()]

    def _static_generator(self):
        """The engine's ``StaticBatchGenerator`` (built once), or None where it is off or unsupported."""
        if not self.static_generate:
            return None
        if self._static_gen is None:
            from eagle3_ray.engines.static_generate import StaticBatchGenerator, unsupported_reason

            reason = unsupported_reason(self.target.model)
            if reason:
                logger.warning("generating with transformers generate (no static decoder: %s)", reason)
                self.static_generate = False
                return None
            self._static_gen = StaticBatchGenerator(self.target.model, sorted(self.eos_ids), self.pad_id)
        return self._static_gen

    def release_generate_state(self) -> None:
        """Free the static decoder's KV storage and graph (it rebuilds them on the next generate)."""
        self._static_gen = None
        if self.target.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        self._static_gen = None
        on_cuda = self.target.device.type == "cuda"
        del self.target
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
