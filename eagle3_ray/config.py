"""One pydantic schema for the whole pipeline.

A YAML file validated here drives every stage. Unknown keys are rejected with their dotted path,
``section.field=value`` overrides apply on top, and the resolved config is written next to every
output (``save_resolved``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagle3_ray.atomic import write_text
from eagle3_ray.errors import ConfigError

RESOLVED_CONFIG_NAME = "config.resolved.yaml"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SGLangConfig(_Section):
    mem_fraction_static: float | None = Field(None, description="SGLang KV-cache memory fraction.")
    nnodes: int = Field(1, ge=1, description="Nodes one tensor-parallel engine spans.")
    dist_init_addr: str | None = Field(None, description="host:port shared by the nodes of one engine.")
    capture_dir: str = Field(
        "/dev/shm", description="Node-local dir where TP rank 0 writes captured features for the engine actor "
        "(a filesystem with hard links, checked at start: a tmpfs such as /dev/shm)."
    )
    extra_engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="More sglang.Engine kwargs; settings that break capture are refused.",
    )
    max_concurrent_calls: int = Field(
        0, ge=0, description="Calls one engine has inside SGLang at once (capture batches, generate batches). "
        "0: as many as its callers' threads (extract.concurrent_batches), so SGLang batches across calls "
        "and never waits for the next one; 1: one at a time. A capture call's features sit in capture_dir "
        "until read.",
    )


class TargetConfig(_Section):
    model: str = Field(
        "smollm2",
        description="'smollm2' (embedded SmolLM2-135M-Instruct), an HF model dir, a .gguf file, "
        "or 'random:<hf config.json or dir>' for seeded random weights.",
    )
    backend: Literal["hf", "sglang"] = Field("hf", description="Capture/generation engine.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = bfloat16 on GPU, float32 on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the HF engine runs.")
    aux_layers: list[int] | None = Field(
        None,
        description="HF hidden_states indices (k = residual after k layers). Default [2, L//2, L-3].",
    )
    seed: int = Field(0, description="Seed for random:<config> targets.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size (SGLang backend).")
    cache_dir: str | None = Field(
        None, description="Where converted targets (GGUF -> safetensors) are cached. "
        "Default: $EAGLE3_RAY_CACHE or ~/.cache/eagle3_ray."
    )
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)

    @field_validator("aux_layers")
    @classmethod
    def _three_sorted_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if len(v) != 3:
            raise ValueError(f"needs exactly 3 layer ids (EAGLE-3 fuses three), got {v}")
        if any(k < 1 for k in v):
            raise ValueError(f"ids are HF hidden_states indices >= 1 (0 is the embeddings), got {v}")
        if sorted(set(v)) != v:
            raise ValueError(f"ids must be strictly increasing, got {v}")
        return v


class DataConfig(_Section):
    path: str | list[str] | None = Field(
        None, description="Conversations or prompts (JSONL/JSON, or builtin:<name>), or a list of them read in "
        "order with ids unique over all (e.g. [prompts.jsonl, builtin:demo_agentic]). Default: the shipped "
        "demo prompts."
    )
    format: Literal["auto", "sharegpt", "openai", "prompts"] = Field(
        "auto", description="Input record form; auto detects per record."
    )

    @field_validator("path")
    @classmethod
    def _files(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and (not v or not all(isinstance(p, str) and p.strip() for p in v)):
            raise ValueError(f"a list of data files must name at least one file and no blank one, got {v}")
        return v
    max_length: int = Field(2048, ge=8, description="Max tokens per sample.")
    truncate: bool = Field(False, description="Truncate over-long samples instead of rejecting them.")
    system_prompt: str | None = Field(None, description="System message prepended when a sample has none.")
    max_samples: int | None = Field(None, ge=1, description="Use only the first N samples.")


class GenerateConfig(_Section):
    max_new_tokens: int = Field(256, ge=1, description="Longest self-distilled answer.")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(
        8, ge=1, description="Prompts per generate() call. On CUDA the HF engine decodes a batch as one "
        "CUDA graph per step, so larger batches (256-512 for a small target) raise throughput."
    )
    seed: int = 0
    samples_per_prompt: int = Field(
        1, ge=1, description="Answers per prompt-only sample. Copy 0 is answered with `temperature` (greedy by "
        "default) under the sample's own id, as with 1; copies 1..n-1 are sampled at `sample_temperature` with "
        "`top_p` and seeds of their own (copy c's calls from `seed + c * 1000003`), under the id `<id>#s<copy>`: "
        "more trajectories of the same target per prompt, so more training tokens from the same prompts "
        "(train.val_share holds a prompt's copies out together). Generation time grows about n-fold."
    )
    sample_temperature: float = Field(
        0.7, gt=0.0, description="Temperature of the sampled copies 1..n-1 (generate.samples_per_prompt > 1)."
    )
    after_tools: Literal["keep", "regenerate"] = Field(
        "keep", description="Assistant turns that answer tool results without calling a tool: 'keep' trains on "
        "them as the data gives them; 'regenerate' has the target write them again (agent logs of another model). "
        "Tool calls and tool results stay as data either way, and a conversation that ends on tool results always "
        "gets the target's reply."
    )
    synthetic_prompts: int = Field(
        0, ge=0, description="User requests the target writes itself before answering (Magpie-style: sampled "
        "from its chat template's user header at temperature 1.0; see data/synthetic.py), spread over the engine "
        "actors, ids `synthetic:<actor>:<k>`, answered like the input's prompts (samples_per_prompt included): "
        "more kinds of the target's answers than a fixed prompt set holds. Written to synthetic.part-*.jsonl "
        "before any is answered, so a resumed run answers the same ones."
    )
    answers: str | None = Field(
        None, description="Answers this target wrote earlier, taken instead of written again: the "
        "conversations.jsonl of an earlier `eagle3-ray generate` (its answers_meta.json beside it) or "
        "builtin:<name> (shipped with <name>.meta.json). Taken only when they were written under this run's "
        "answer settings (target, dtype, seeds, system prompt, answer length, temperature, top_p, after_tools: "
        "the meta) and only for the records whose messages before each answer are this input's; the rest are "
        "generated. How the stage gets its answers, not what they are: not part of the stage hashes."
    )


class ExtractConfig(_Section):
    batch_tokens: int = Field(8192, ge=1, description="Token budget of one engine forward.")
    num_actors: int = Field(1, ge=1, description="Engine actors (min size of the pool).")
    max_actors: int | None = Field(None, ge=1, description="Max pool size (elastic); default = num_actors.")
    num_gpus_per_actor: float = Field(0.0, ge=0.0, description="GPUs per engine actor (0 on CPU).")
    num_cpus_per_actor: float = Field(
        1.0, gt=0.0, description="CPUs per engine actor; on CPU-only runs this also sets its torch threads."
    )
    concurrent_batches: int | None = Field(
        None, ge=1, description="Batches one engine actor runs at once (threads): the next forward "
        "overlaps the last one's device-to-host copy and writes. Default 3 on GPU (measured best with both "
        "backends, docs/pipeline.md), 1 on CPU."
    )
    shard_max_bytes: int = Field(
        256 * 2**20, ge=1, description="Shard size where features stream through Ray Data (online/hybrid "
        "writes); offline extraction commits one shard per engine batch (~batch_tokens x 8H bytes)."
    )
    disk_margin: float = Field(1.1, ge=1.0, description="Preflight needs projected bytes x margin free.")
    max_bytes_in_flight: int = Field(
        2 * 2**30, ge=2**20, description="Online/hybrid: object-store bytes the streamed features may "
        "hold at once (Ray Data back-pressure between the engine actors and the trainer)."
    )
    on_corrupt_shard: Literal["skip", "abort"] = Field("abort", description="Reader policy.")
    compact: Literal["none", "fp8"] = Field(
        "none", description="Stored feature format. fp8: aux/last hidden states as float8_e4m3fn with one fp32 "
        "scale per token and layer (4H+16 instead of 8H bytes/token, ~0.5x); readers still get bf16. A store "
        "holds one format (docs/feature-store.md)."
    )


class VocabConfig(_Section):
    draft_vocab_size: int = Field(32000, ge=1, description="Draft vocabulary size.")


class DrafterShape(_Section):
    hidden_size: int | None = Field(None, description="Default: the target's.")
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None


class TrainConfig(_Section):
    mode: Literal["offline", "online", "hybrid"] = Field(
        "offline", description="offline: extract to the feature store, then train on it; online: stream "
        "captured features into the trainer, no disk; hybrid: stream epoch 0 and write the store, later "
        "epochs read the store."
    )
    ttt_steps: int = Field(7, ge=1, description="Training-time-test unroll length.")
    attention: Literal["auto", "sdpa", "varlen", "flex"] = Field(
        "auto", description="TTT attention, the same function four ways: varlen (each sample's causal prefix "
        "through flash attention's varlen kernel, the TTT diagonal computed apart; CUDA, or a slow reference "
        "elsewhere), sdpa (dense mask over the whole TTT cache, any device), flex (block-sparse "
        "flex_attention, compiled; CUDA only; 5x slower than sdpa on an H200). auto = varlen on CUDA, sdpa "
        "elsewhere."
    )
    loss_kernel: Literal["auto", "triton", "torch"] = Field(
        "auto", description="The TTT loss's soft cross-entropy, the same function two ways: triton (one fused "
        "kernel per direction over the drafter's logits; CUDA) or torch (plain ops, any device; keeps fp32 "
        "copies of the logits for the backward). auto = triton on CUDA where Triton imports, torch elsewhere."
    )
    loss_chunk_tokens: int = Field(
        0, ge=0, description="Long samples: each TTT step's draft logits and soft cross-entropy over chunks of at "
        "most this many tokens, each recomputed in the backward (activation checkpointing), so no step keeps "
        "[tokens, draft vocab] logits for the backward (14.7 GB at 32K tokens, 7 steps, draft vocab 32000); costs "
        "one more lm_head forward. The same loss and gradients. 0 = off (docs/drafter.md, \"Long samples\")."
    )
    recompute_ttt_steps: bool | int = Field(
        False, description="Long samples: recompute TTT steps' drafter activations in the backward (activation "
        "checkpointing) instead of keeping them; of a recomputed step only its hidden state and keys/values are "
        "kept. true = every step, false or 0 = none, k (1..ttt_steps) = the first k steps (0..k-1): recompute "
        "only as many as the sample needs to fit. Each recomputed step costs one more drafter forward of that "
        "step. The same loss and gradients."
    )
    compile: bool = Field(False, description="torch.compile the drafter layer (GPU training; ~1 min warm-up).")
    loss_decay: float = Field(0.8, gt=0.0, le=1.0, description="Weight of step i is decay**i.")
    lr: float = Field(1e-4, gt=0.0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine floor as a fraction of lr.")
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(0.5, gt=0.0)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Stop after N optimizer steps.")
    val_share: float = Field(
        0.0, ge=0.0, lt=1.0, description="Share of the feature store's samples held out of training (seeded "
        "by `seed`); their simulated tau (val_tau, val_acc_0, val_loss in metrics.jsonl) shows over-fitting "
        "as it happens. Offline mode only."
    )
    val_groups: dict[str, str] = Field(
        default_factory=dict, description="Named groups of samples, {name: regex}: a sample belongs to the first "
        "group whose regex matches its whole id (generate's copies are <id>#s<k>). Every held-out evaluation "
        "also reports each group's held-out samples apart (val_tau/<name>, val_tau_chain3/<name>, "
        "val_acc_0/<name>, val_tokens/<name> in metrics.jsonl). Offline mode only."
    )
    eval_only: list[str] = Field(
        default_factory=list, description="Groups of val_groups never trained on: all their samples are held out "
        "(val_share then splits the rest) and left out of the vocab map's token counts. For an evaluation set "
        "answered by the target with the training data, e.g. MT-bench's questions added to --data: its "
        "simulated tau at every evaluation, the tau-against-tokens curve of that set (docs/pipeline.md)."
    )
    eval_every: int = Field(
        200, ge=1, description="Optimizer steps between held-out evaluations (at the first logged step at or "
        "after each multiple, and at the last step)."
    )
    val_cache_bytes: int = Field(
        4 * 2**30, ge=0, description="Held-out rows a worker keeps in host memory after its first evaluation, "
        "up to this many bytes, so that later evaluations start no Ray Data execution (each one cost 14-16 s "
        "on an H200); over it, every evaluation reads the store again. 0 = always read."
    )
    batch_tokens: int = Field(4096, ge=1, description="Tokens per micro-batch per worker (packing budget).")
    row_tokens: int | None = Field(
        2048, ge=1, description="sdpa attention: lay a pack out as rows of whole samples of about this many "
        "tokens (the same loss; dense attention then costs rows x R^2 instead of N^2). None = one row."
    )
    grad_accum: int = Field(1, ge=1)
    prefetch_packs: int = Field(
        2, ge=1, description="Packs each worker fetches and copies to its device ahead of the running step."
    )
    pack_loaders: int = Field(
        2, ge=1, description="Ray Data actors per training worker reading packs from the store (at the 8B "
        "shape a pack is 64 MB and a worker takes ~9 per second: two keep it fed)."
    )
    num_workers: int = Field(1, ge=1, description="Ray Train workers.")
    context_parallel: int = Field(
        1, ge=1, description="Context parallelism: workers per group that split one pack's tokens (one sample "
        "longer than a worker's memory holds); the groups (num_workers / context_parallel) are data parallel. A "
        "group trains on packs of up to context_parallel x batch_tokens tokens, split contiguously; the drafter's "
        "attention gathers the keys it needs, the loss and gradients are those of one worker (docs/drafter.md, "
        "\"Context parallelism\"). Needs num_workers a multiple of it, train.mode=offline, attention sdpa, varlen "
        "or auto. 1 = off."
    )
    cpus_per_worker: int = Field(1, ge=1, description="CPUs (and torch threads on CPU) per training worker.")
    use_gpu: bool | None = Field(None, description="Default: True when the cluster has GPUs.")
    zero_stage: int = Field(1, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(200, ge=1, description="Optimizer steps between checkpoints.")
    max_failures: int = Field(3, ge=0, description="Ray Train FailureConfig.max_failures.")
    init_from: str | None = Field(None, description="Exported drafter dir to finetune (default: from scratch).")
    seed: int = 0
    drafter: DrafterShape = Field(default_factory=DrafterShape)

    @field_validator("val_groups")
    @classmethod
    def _group_patterns(cls, groups: dict[str, str]) -> dict[str, str]:
        for name, pattern in groups.items():
            if not name or "/" in name:
                raise ValueError(f"group name {name!r}: give a non-empty name without '/' (metrics are "
                                 "named val_tau/<name>)")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"group {name!r}: {pattern!r} is not a regular expression ({e}); a group is "
                                 "{name: regex matching whole sample ids}, e.g. {mt_bench: 'mtbench-.*'}") from None
        return groups

    @model_validator(mode="after")
    def _context_parallel_layout(self) -> "TrainConfig":
        if self.context_parallel > 1:  # torch only then: the config loads without it otherwise
            from eagle3_ray.train.context_parallel import check_config

            check_config(self.context_parallel, self.num_workers, self.mode, self.attention, self.compile)
        return self

    @model_validator(mode="after")
    def _recomputed_steps(self) -> "TrainConfig":
        k = self.recompute_ttt_steps
        if not isinstance(k, bool) and not 0 <= k <= self.ttt_steps:
            raise ValueError(f"train.recompute_ttt_steps={k}: give true (every TTT step), false (none), or k from 0 "
                             f"to train.ttt_steps={self.ttt_steps} (the first k steps recomputed)")
        return self

    @model_validator(mode="after")
    def _eval_only_groups(self) -> "TrainConfig":
        unknown = [g for g in self.eval_only if g not in self.val_groups]
        if unknown:
            raise ValueError(f"eval_only names {unknown}, which train.val_groups does not define "
                             f"({sorted(self.val_groups) or 'none'}); define each as val_groups.<name>=<regex>")
        return self


class PromptSetEntry(_Section):
    """One prompt set of ``bench.prompts`` given as a mapping."""

    path: str = Field(description="MT-bench-style or single-turn JSONL/JSON file, or builtin:<name>.")
    max_prompts: int | None = Field(None, ge=1, description="This set's cap (default: bench.max_prompts).")
    name: str | None = Field(None, description="The set's name in results and reports (default: the file's stem).")


PROMPT_ENTRY_FORM = "a path, builtin:<name>, or a mapping {path: <file>, max_prompts: <n>, name: <set name>}"


class BenchReference(_Section):
    """``bench.reference``: a measured record the report's opening cites beside this run's figures."""

    record: str = Field(description="A result record, e.g. benchmarks/results/records/product8.json (relative to "
                        "the working directory or to the repository the package runs from).")
    text: str = Field(description="The sentence, its figures as {key} (with a format spec, {key:.2f}) read from "
                      "the record's values; also {machine} and {date}.")


class BenchConfig(_Section):
    prompts: str | PromptSetEntry | list[str | PromptSetEntry] | None = Field(
        None, description="One prompt set or a list of them (MT-bench, GSM8K, HumanEval, Spec-Bench, ...); each "
        "is a path / builtin:<name> or {path, max_prompts, name}. Several sets are reported per set, their "
        "categories named <set>/<category>. Default: shipped demo eval prompts."
    )
    max_prompts: int | None = Field(
        None, ge=1, description="Prompts per set at most, round-robin over its categories (an entry's own "
        "max_prompts wins)."
    )
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    modes: list[Literal["chain", "tree"]] = Field(default_factory=lambda: ["chain", "tree"])
    num_steps: int = Field(3, ge=1, description="Chain depth K.")
    topk: int = Field(4, ge=1, description="Tree branching.")
    depth: int = Field(5, ge=1, description="Tree depth.")
    total_tokens: int = Field(16, ge=1, description="Tree draft tokens verified per step.")
    prompt_lookup: bool = Field(True, description="Also run prompt-lookup decoding as a peer.")
    untrained: bool = Field(
        True, description="`eagle3-ray run`'s bench stage also decodes chain mode with an untrained drafter (tau 1: "
        "what the trained drafter buys, and the verify forward's own bf16 divergences); one more full pass over "
        "the turns. `eagle3-ray bench` runs it only when asked (run_bench(compare_untrained=True))."
    )
    cuda_graphs: bool = Field(
        True, description="On CUDA, decode (baseline included) through a StaticTarget: preallocated KV cache "
        "and CUDA graphs per verify width (docs/decode.md). Off CUDA it has no effect."
    )
    draft_graphs: bool = Field(
        True, description="With cuda_graphs on CUDA, the drafter too runs on a static KV cache with CUDA-graphed "
        "chain/tree steps (decode.StaticProposer); false drafts eagerly (the reference path, for comparison)."
    )
    max_length: int = Field(8192, ge=16, description="Longest prompt + new tokens of a StaticTarget generation.")
    engine: Literal["auto", "hf", "sglang", "both"] = Field(
        "auto", description="Which engine decodes: 'sglang' (SGLang's own EAGLE-3 against SGLang's plain "
        "decoding, both with CUDA graphs unless cuda_graphs is false; needs CUDA GPUs and SGLang), 'hf' (the "
        "project's own decoder: CPU, or targets SGLang cannot run), 'both' (the two on the same prompts, "
        "and how far SGLang's tau is from the project's own), 'auto' (target.backend's engine). "
        "Independent of the engine that captured the features."
    )
    concurrency: list[int] = Field(
        default_factory=lambda: [1, 8, 32], min_length=1, description="SGLang bench: requests in flight, "
        "each measured on the same turns in every mode (the speedup curve over concurrency)."
    )
    num_gpus: float = Field(0.0, ge=0.0)
    num_cpus: float = Field(1.0, gt=0.0, description="CPUs of the benchmark actor (its torch threads on CPU).")
    reference: BenchReference | None = Field(
        None, description="A record of what the same drafter recipe gives elsewhere (a GPU), {record, text}: the "
        "report's opening says it after this run's own tau and speedup, its figures read from the record."
    )

    @field_validator("concurrency")
    @classmethod
    def _concurrency(cls, value: list[int]) -> list[int]:
        if any(c < 1 for c in value) or len(set(value)) != len(value):
            raise ValueError(f"{value}: give distinct request counts >= 1, e.g. [1, 8, 32]")
        return sorted(value)

    def bench_engine(self, backend: str) -> str:
        """The engine that decodes: ``engine``, or the target's backend for 'auto'."""
        return backend if self.engine == "auto" else self.engine

    @field_validator("prompts", mode="before")
    @classmethod
    def _prompt_entries(cls, value: Any) -> Any:
        """Each mapping entry checked on its own, so that a mistake reads as one line naming the entry."""
        if value is None or isinstance(value, str):
            return value
        listed = isinstance(value, (list, tuple))
        entries = list(value) if listed else [value]
        if listed and not entries:
            raise ValueError(f"an empty list; give at least one prompt set: {PROMPT_ENTRY_FORM}")
        checked = []
        for i, entry in enumerate(entries):
            where = f"entry {i}" if listed else "the value"
            if isinstance(entry, (str, PromptSetEntry)):
                checked.append(entry)
                continue
            if not isinstance(entry, dict):
                raise ValueError(f"{where} {entry!r} is not a prompt set; an entry is {PROMPT_ENTRY_FORM}")
            unknown = sorted(str(k) for k in entry if k not in PromptSetEntry.model_fields)
            if unknown:
                raise ValueError(f"{where} has unknown key(s) {unknown}; an entry takes only "
                                 f"{list(PromptSetEntry.model_fields)}")
            try:
                checked.append(PromptSetEntry.model_validate(entry))
            except ValidationError as e:
                problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
                raise ValueError(f"{where} {entry!r}: {problems}") from None
        return checked if listed else checked[0]


class RayConfig(_Section):
    address: str | None = Field(None, description="Ray address; None = connect or start locally.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs for a locally started Ray.")
    storage_path: str | None = Field(None, description="Ray Train storage (default: <out>/ray_train).")
    env_vars: dict[str, str] = Field(default_factory=dict, description="runtime_env env vars.")


class PipelineConfig(_Section):
    name: str = "eagle3"
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    ray: RayConfig = Field(default_factory=RayConfig)


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {path}: unknown key; remove it or fix its spelling")
        else:
            lines.append(f"  {path}: {e['msg']} (got {e.get('input')!r})")
    return f"invalid config {source}:\n" + "\n".join(lines)


def _parse_value(raw: str) -> Any:
    """Override values are YAML scalars/lists: `3`, `true`, `null`, `[2, 8, 12]`, `text`."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = _parse_value(raw)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML config (None = all defaults), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory; pass -c with a YAML file (see configs/)")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass -c with a YAML file (see configs/)")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, overrides or [])
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def config_to_dict(cfg: PipelineConfig) -> dict[str, Any]:
    return json.loads(cfg.model_dump_json())


def save_resolved(cfg: PipelineConfig, out_dir: str | Path, name: str = RESOLVED_CONFIG_NAME) -> Path:
    """Write the resolved config next to a stage's outputs (atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / name
    write_text(target, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return target
