"""The schema's sections other than `train` (config/train.py): target, data, generate, extract, vocab,
bench, ray. Every field has a default and a one-line description (`eagle3-ray config --explain`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class Section(BaseModel):
    """A config section: unknown keys are refused, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SGLangConfig(Section):
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


class TargetConfig(Section):
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
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description="SGLang engine settings (backend sglang).")

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


class DataConfig(Section):
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


class GenerateConfig(Section):
    max_new_tokens: int = Field(256, ge=1, description="Longest self-distilled answer.")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of sampled answers (1 = off).")
    batch_size: int = Field(
        8, ge=1, description="Prompts per generate() call. On CUDA the HF engine decodes a batch as one "
        "CUDA graph per step, so larger batches (256-512 for a small target) raise throughput."
    )
    seed: int = Field(0, description="Seed of sampled answers (temperature > 0, copies 1..n-1).")
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


class ExtractConfig(Section):
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
    audit_rows: float = Field(
        0.1, ge=0.0, le=1.0, description="Share of each sample's rows the capture audit reads with the target's "
        "lm_head (0 = no audit; the final-norm check still reads every row). docs/feature-store.md, "
        "\"Capture audit\"."
    )
    audit_min_agreement: float = Field(
        0.8, ge=0.0, le=1.0, description="Least share of greedy-answer rows where lm_head(last_hidden) picks the "
        "next token, per shard."
    )
    audit_max_nll_excess: float = Field(
        1.0, description="Most mean next-token NLL above the target's own entropy on assistant rows (nats), "
        "per shard."
    )
    audit_max_unnormed: float = Field(
        0.001, ge=0.0, le=1.0, description="Most share of rows whose last_hidden is not the final RMSNorm's "
        "output, per shard (1 turns the check off, for a target whose final norm is not x*w/rms(x))."
    )


class VocabConfig(Section):
    draft_vocab_size: int = Field(32000, ge=1, description="Draft vocabulary size.")



class PromptSetEntry(Section):
    """One prompt set of ``bench.prompts`` given as a mapping."""

    path: str = Field(description="MT-bench-style or single-turn JSONL/JSON file, or builtin:<name>.")
    max_prompts: int | None = Field(None, ge=1, description="This set's cap (default: bench.max_prompts).")
    name: str | None = Field(None, description="The set's name in results and reports (default: the file's stem).")


PROMPT_ENTRY_FORM = "a path, builtin:<name>, or a mapping {path: <file>, max_prompts: <n>, name: <set name>}"


class BenchReference(Section):
    """``bench.reference``: a measured record the report's opening cites beside this run's figures."""

    record: str = Field(description="A result record, e.g. benchmarks/results/records/product8.json (relative to "
                        "the working directory or to the repository the package runs from).")
    text: str = Field(description="The sentence, its figures as {key} (with a format spec, {key:.2f}) read from "
                      "the record's values; also {machine} and {date}.")


class BenchConfig(Section):
    prompts: str | PromptSetEntry | list[str | PromptSetEntry] | None = Field(
        None, description="One prompt set or a list of them (MT-bench, GSM8K, HumanEval, Spec-Bench, ...); each "
        "is a path / builtin:<name> or {path, max_prompts, name}. Several sets are reported per set, their "
        "categories named <set>/<category>. Default: shipped demo eval prompts."
    )
    max_prompts: int | None = Field(
        None, ge=1, description="Prompts per set at most, round-robin over its categories (an entry's own "
        "max_prompts wins)."
    )
    max_new_tokens: int = Field(128, ge=1, description="New tokens per turn at most (tau depends on it).")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy, where decoding must equal the target's own.")
    modes: list[Literal["chain", "tree"]] = Field(default_factory=lambda: ["chain", "tree"], description="Speculative "
                                                  "decoding modes to measure: chain (top-1) and tree (EAGLE-2).")
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
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs of the benchmark actor.")
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


class RayConfig(Section):
    address: str | None = Field(None, description="Ray address; None = connect or start locally.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs for a locally started Ray.")
    storage_path: str | None = Field(None, description="Ray Train storage (default: <out>/ray_train).")
    env_vars: dict[str, str] = Field(default_factory=dict, description="runtime_env env vars.")
