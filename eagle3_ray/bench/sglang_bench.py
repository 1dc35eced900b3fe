"""SGLang's own EAGLE-3 speculative decoding against SGLang's plain decoding. No Ray in here.

Three engines run one after the other on the same GPUs, each holding the whole KV-cache budget and
each with CUDA graphs unless ``bench.cuda_graphs`` is false: ``plain`` (``engine_kwargs(mode=
"generate")``), ``chain`` (EAGLE3, top-1, ``bench.num_steps`` drafts) and ``tree`` (EAGLE3,
``bench.topk`` x ``bench.depth``, ``bench.total_tokens`` verified), as ``bench.modes`` asks.

The turns: the plain engine answers every conversation turn by turn at concurrency 1, its own
replies becoming the history (``plan_turns``; a prompt's fixed ``answers`` instead, where it has
them). That fixes every turn's prompt ids; every other measurement (plain at higher concurrency,
chain and tree at every concurrency) answers exactly those prompts, so all modes decode the same
turns. At concurrency c the prompts are sent with at most c requests in flight (``serve``), as a
server sees c users.

Counted from SGLang's own per-request counters (``meta_info``): ``completion_tokens``,
``spec_verify_ct`` (target verify forwards) and ``spec_correct_drafts_histogram`` (verify steps that
accepted exactly i drafts). ``tau`` = tokens appended by verify steps / verify steps, the project's
definition (docs/bench.md; the prefill's first token is not a verify step's), and
``accept_length`` = completion_tokens / verify steps, SGLang's own ``spec_accept_length``.
tokens/s at concurrency 1 = completion tokens / the requests' summed latency; above 1 = completion
tokens / wall seconds of the whole batch. Speedup = a mode's tokens/s over plain's at the same
concurrency on the same turns.
Call it in a process that owns ``target.tp_size`` GPUs (``bench.runner`` runs it in a Ray task).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from eagle3_ray.bench.prompts import Prompt
from eagle3_ray.config import BenchConfig, PipelineConfig
from eagle3_ray.engines.sglang_args import (
    check_server_args,
    engine_kwargs,
    generate_sampling,
    graph_max_bs,
    import_sglang,
    server_args_fields,
)
from eagle3_ray.engines.sglang_process import EngineLoop, launch_sglang
from eagle3_ray.progress import say

SPEC_MODES = ("chain", "tree")
WARMUP_TOKENS = 32
STALL_S = 300.0  # no request answered for this long, the engine's processes alive: it hangs
PROGRESS_EVERY = 10  # conversations between progress lines of the turn planning
EngineFactory = Callable[..., Any]  # sglang.Engine(**kwargs), or a test's fake


@dataclass(frozen=True)
class TurnPrompt:
    """One turn to answer: its conversation (category, prompt id), turn index and full prompt ids."""

    category: str
    prompt_id: str
    turn: int
    ids: list[int]


def request_record(out: dict[str, Any], seconds: float) -> dict[str, Any]:
    """One answer of SGLang reduced to its counters (``spec_*`` None for plain decoding)."""
    meta = out["meta_info"]
    hist = meta.get("spec_correct_drafts_histogram") or meta.get("spec_accept_histogram")
    verify = meta.get("spec_verify_ct")
    return {
        "completion_tokens": int(meta["completion_tokens"]),
        "spec_verify_ct": int(verify) if verify else None,
        "accept_histogram": [int(x) for x in hist] if hist else None,
        "seconds": seconds,
        "output_ids": [int(t) for t in out["output_ids"]],
    }


class Served:
    """One bench engine: its loop run by a thread of its own (``EngineLoop``) while this thread watches
    its processes; requests answered are counted, so that an engine that stops answering ends the
    mode with an error after ``STALL_S`` and a long batch prints its progress."""

    def __init__(self, loop: Any, label: str):
        self.loop, self.label = loop, label
        self.answered = 0
        self.tokens = 0

    def serve(self, prompts: Sequence[Sequence[int]], sampling: dict[str, Any], concurrency: int,
              phase: str = "") -> tuple[list[dict[str, Any]], float]:
        """Answer ``prompts`` with at most ``concurrency`` requests in flight. Returns the records in
        prompt order and the wall seconds of the whole batch."""
        engine = self.loop.engine

        async def one(ids: Sequence[int], gate: asyncio.Semaphore) -> dict[str, Any]:
            async with gate:
                start = time.perf_counter()
                out = await engine.async_generate(input_ids=list(ids), sampling_params=dict(sampling))
                record = request_record(out, time.perf_counter() - start)
                self.answered += 1
                self.tokens += record["completion_tokens"]
                return record

        async def batch() -> tuple[list[dict[str, Any]], float]:
            gate = asyncio.Semaphore(concurrency)
            start = time.perf_counter()
            records = await asyncio.gather(*(one(ids, gate) for ids in prompts))
            return list(records), time.perf_counter() - start

        first, tokens, began = self.answered, self.tokens, time.perf_counter()

        def report() -> None:
            say(f"[bench] SGLang {self.label} {phase}: {self.answered - first}/{len(prompts)} requests, "
                f"{self.tokens - tokens:,} tokens in {time.perf_counter() - began:.0f} s")

        return self.loop.call(batch(), progress=lambda: self.answered, stall_s=STALL_S, report=report)


def plan_turns(
    served: Served,
    sampling: dict[str, Any],
    conversations: dict[str, list[tuple]],
    render: Callable[[list[dict], list[dict] | None], list[int]],
    decode: Callable[[list[int]], str],
) -> tuple[list[TurnPrompt], list[dict[str, Any]]]:
    """Plain decoding at concurrency 1, conversation by conversation, each reply the next turn's
    history (or the conversation's own replies, where it has them: ``Prompt.conversation``). Returns
    every turn's prompt and its record (the plain concurrency-1 measurement)."""
    turns: list[TurnPrompt] = []
    records: list[dict[str, Any]] = []
    total = sum(len(convs) for convs in conversations.values())
    began = time.perf_counter()
    for category, convs in conversations.items():
        for prompt_id, texts, *given in convs:
            prompt = _prompt(category, prompt_id, texts, given)
            replies: list[str] = []
            for turn in range(len(texts)):
                ids = render(prompt.conversation(turn, replies), prompt.tools)
                (record,), _ = served.serve([ids], sampling, 1, "c1")
                turns.append(TurnPrompt(category, prompt_id, turn, ids))
                records.append(record)
                replies.append(decode(record["output_ids"]))
            done = len({(t.category, t.prompt_id) for t in turns})
            if done % PROGRESS_EVERY == 0 or done == total:
                tokens = sum(r["completion_tokens"] for r in records)
                say(f"[bench] SGLang {served.label} c1: {done}/{total} conversations, {len(records)} turns, "
                    f"{tokens:,} tokens in {time.perf_counter() - began:.0f} s")
    return turns, records


def summarize(records: list[dict[str, Any]], wall: float | None = None) -> dict[str, Any]:
    """Totals of one mode at one concurrency. ``wall``: the batch's wall seconds (None: the summed
    latencies, concurrency 1)."""
    tokens = sum(r["completion_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records) if wall is None else wall
    spec = [r for r in records if r.get("spec_verify_ct")]
    verify = sum(r["spec_verify_ct"] for r in spec)
    spec_tokens = sum(r["completion_tokens"] for r in spec)
    hist = _sum_histograms([r["accept_histogram"] for r in spec if r.get("accept_histogram")])
    steps = sum(hist)
    return {
        "tau": (spec_tokens - len(spec)) / verify if verify else None,  # verify steps' tokens / steps
        "accept_length": spec_tokens / verify if verify else None,  # SGLang's spec_accept_length
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "completion_tokens": tokens,
        "verify_steps": verify if spec else None,
        "accept_histogram": hist or None,
        # rate of verify steps accepting at least i drafts, i = 1..K
        "accept_by_position": [sum(hist[i:]) / steps for i in range(1, len(hist))] if steps else [],
        "ms_per_cycle": 1000 * seconds / verify if verify and wall is None else None,
        "seconds": seconds,
        "requests": len(records),
        "mean_latency_s": sum(r["seconds"] for r in records) / len(records) if records else None,
    }


def _sum_histograms(hists: list[list[int]]) -> list[int]:
    width = max((len(h) for h in hists), default=0)
    return [sum(h[i] for h in hists if i < len(h)) for i in range(width)]


def crossing(speedups: dict[int, float | None]) -> str:
    """Where a speedup curve over concurrency crosses 1, in words (log-linear interpolation)."""
    points = sorted((c, s) for c, s in speedups.items() if s is not None)
    if not points:
        return "not measured"
    if all(s >= 1 for _, s in points):
        c, s = points[-1]
        return f"above 1 at every measured concurrency ({s:.2f}x at {c})"
    if all(s < 1 for _, s in points):
        return f"below 1 at every measured concurrency ({points[0][1]:.2f}x at {points[0][0]})"
    for (c0, s0), (c1, s1) in zip(points, points[1:]):
        if (s0 >= 1) != (s1 >= 1):
            x0, x1 = math.log2(c0), math.log2(c1)
            at = 2 ** (x0 + (1 - s0) * (x1 - x0) / (s1 - s0))
            return f"crosses 1 between concurrency {c0} ({s0:.2f}x) and {c1} ({s1:.2f}x), near {at:.0f}"
    return "not monotone"


def mode_kwargs(cfg: PipelineConfig, mode: str, drafter_dir: str, fields: frozenset[str] | None = None
                ) -> dict[str, Any]:
    """The exact ``sglang.Engine`` kwargs of one bench mode (plain, chain or tree). ``fields``: the
    ServerArgs field names (default: the installed SGLang's)."""
    if mode == "plain":
        kw = engine_kwargs(cfg.target, "generate")
    else:
        kw = engine_kwargs(cfg.target, "spec", drafter_dir=drafter_dir, bench=cfg.bench, spec_shape=mode)
    return {**kw, **graph_kwargs(cfg.bench, kw, server_args_fields() if fields is None else fields)}


def graph_kwargs(bench: BenchConfig, kw: dict[str, Any], fields: frozenset[str]) -> dict[str, Any]:
    """CUDA graphs on, captured up to the largest concurrency measured (fewer graphs to capture than
    SGLang's default sizes), or off; the user's extra_engine_kwargs decide where they say."""
    if not bench.cuda_graphs:
        return {"disable_cuda_graph": True}
    return graph_max_bs(kw, max(bench.concurrency), fields)


def run_mode(
    cfg: PipelineConfig,
    mode: str,
    drafter_dir: str,
    conversations: dict[str, list[tuple]] | None = None,
    turns: list[TurnPrompt] | None = None,
    factory: EngineFactory | None = None,
) -> dict[str, Any]:
    """Start one engine, measure ``mode`` at every ``bench.concurrency``, shut it down.

    plain takes ``conversations`` (``{category: [(prompt_id, user turns)]}``) and plans the turns
    (returned as ``turns``); chain and tree take those ``turns``."""
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.engines.describe import load_tokenizer

    b = cfg.bench
    if factory is None:
        factory = import_sglang().Engine
        kwargs = mode_kwargs(cfg, mode, drafter_dir)
        check_server_args(kwargs)
    else:  # a test's fake names the ServerArgs fields it stands for
        kwargs = mode_kwargs(cfg, mode, drafter_dir, getattr(factory, "server_args_fields", frozenset()))
    sampling = generate_sampling(b.max_new_tokens, b.temperature, 1.0, cfg.generate.seed)
    tok = load_tokenizer(cfg.target)
    render = lambda messages, tools=None: render_generation_prompt(tok, messages, tools)  # noqa: E731
    what = f"the SGLang {mode} engine of the bench"
    started = time.perf_counter()
    engine, procs = launch_sglang(kwargs, factory, what=what)
    start_seconds = time.perf_counter() - started
    say(f"[bench] SGLang {mode}: engine up in {start_seconds:.0f} s")
    served = Served(EngineLoop(engine, procs, what), mode)
    try:
        first = turns[0].ids if turns else render([{"role": "user", "content": _first_text(conversations)}])
        warm = dict(sampling, max_new_tokens=min(WARMUP_TOKENS, b.max_new_tokens))
        served.serve([first], warm, 1, "warm-up")  # not timed: first-call costs
        served.serve([first] * min(8, max(b.concurrency)), warm, max(b.concurrency), "warm-up")
        by_c: dict[str, dict[str, Any]] = {}
        c1_records = None
        if mode == "plain":
            turns, c1_records = plan_turns(served, sampling, conversations or {}, render,
                                           lambda ids: tok.decode(ids, skip_special_tokens=True))
        assert turns is not None, "chain and tree answer the turns plain decoding planned"
        for c in b.concurrency:
            if c == 1 and c1_records is not None:
                records, wall = c1_records, None
            else:
                records, wall = served.serve([t.ids for t in turns], sampling, c, f"c{c}")
                wall = None if c == 1 else wall
                if c == 1:
                    c1_records = records
            by_c[str(c)] = row = summarize(records, wall)
            say(f"[bench] SGLang {mode} c{c}: {row['tokens_per_s']:.1f} tokens/s"
                + (f", tau {row['tau']:.2f}" if row.get("tau") else ""))
        return {
            "mode": mode,
            "start_seconds": start_seconds,
            "device": _device_name(),
            "server_args": {k: v for k, v in kwargs.items() if k.startswith(("speculative_", "cuda_graph", "disable_cuda"))},
            "by_concurrency": by_c,
            "c1_records": c1_records,
            "turns": [asdict(t) for t in turns] if mode == "plain" else None,
        }
    finally:
        served.loop.close()


def _device_name() -> str:
    import torch

    return f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cuda"


def _first_text(conversations: dict[str, list[tuple]] | None) -> str:
    return next(conv[1][0] for convs in (conversations or {}).values() for conv in convs)


def combine(parts: dict[str, dict[str, Any]], concurrency: list[int]) -> dict[str, Any]:
    """results.json's ``sglang`` section from the modes' ``run_mode`` outputs (plain first)."""
    plain = parts["plain"]
    turns = [TurnPrompt(**t) for t in plain["turns"]]
    modes = {m: p["by_concurrency"] for m, p in parts.items() if "by_concurrency" in p}
    speedup: dict[str, dict[str, float | None]] = {}
    for mode in (m for m in modes if m != "plain"):
        speedup[mode] = {str(c): _ratio(modes[mode].get(str(c)), modes["plain"].get(str(c))) for c in concurrency}
    base_c1 = plain["c1_records"]
    identical = {m: _identical(p["c1_records"], base_c1) for m, p in parts.items()
                 if m != "plain" and p.get("c1_records")}
    return {
        "engine": "sglang",
        "concurrency": list(concurrency),
        "modes": modes,
        "speedup": speedup,
        "crossing": {m: crossing({int(c): s for c, s in curve.items()}) for m, curve in speedup.items()},
        "identical_to_plain": identical,
        "per_category": _grouped(parts, turns, lambda t: t.category),
        "per_turn": _grouped(parts, turns, lambda t: str(t.turn + 1)),
        "start_seconds": {m: p.get("start_seconds") for m, p in parts.items()},
        "device": plain.get("device") or "cuda",  # where the engines ran (the task's GPU, not the driver's)
        "server_args": {m: p.get("server_args") for m, p in parts.items()},
        "errors": {m: p["error"] for m, p in parts.items() if p.get("error")},
        "num_turns": len(turns),
        "num_prompts": len({(t.category, t.prompt_id) for t in turns}),
    }


def _ratio(row: dict[str, Any] | None, base: dict[str, Any] | None) -> float | None:
    tps, base_tps = (row or {}).get("tokens_per_s"), (base or {}).get("tokens_per_s")
    return tps / base_tps if tps and base_tps else None


def _identical(records: list[dict[str, Any]], base: list[dict[str, Any]]) -> float | None:
    pairs = list(zip(records, base))
    return sum(r["output_ids"] == b["output_ids"] for r, b in pairs) / len(pairs) if pairs else None


def _grouped(parts: dict[str, dict[str, Any]], turns: list[TurnPrompt], key: Callable[[TurnPrompt], str]
             ) -> dict[str, dict[str, Any]]:
    """Concurrency-1 summaries per group of turns (a category, a turn index), with speedups."""
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(turns):
        groups.setdefault(key(t), []).append(i)
    out: dict[str, dict[str, Any]] = {}
    for name, idx in groups.items():
        rows = {m: summarize([p["c1_records"][i] for i in idx]) for m, p in parts.items() if p.get("c1_records")}
        for m, row in rows.items():
            row["speedup"] = _ratio(row, rows.get("plain")) if m != "plain" else 1.0
        out[name] = rows
    return out


def summary_keys(section: dict[str, Any], hf_tau: dict[str, float | None] | None = None) -> dict[str, Any]:
    """The headline figures of an SGLang bench: ``sglang_spec_vs_plain_<mode>_c<c>``,
    ``sglang_tau_<mode>`` (concurrency 1) and, given the project's own HF bench tau of the same
    turns, ``sglang_vs_own_tau_diff_<mode>`` (SGLang minus HF)."""
    keys: dict[str, Any] = {}
    for mode, curve in section["speedup"].items():
        for c, s in curve.items():
            keys[f"sglang_spec_vs_plain_{mode}_c{c}"] = s
    for mode, by_c in section["modes"].items():
        if mode != "plain":
            keys[f"sglang_tau_{mode}"] = (by_c.get("1") or next(iter(by_c.values()), {})).get("tau")
    for mode, tau in (hf_tau or {}).items():
        own = keys.get(f"sglang_tau_{mode}")
        keys[f"sglang_vs_own_tau_diff_{mode}"] = own - tau if own is not None and tau is not None else None
    keys["sglang_cuda_graphs"] = all("disable_cuda_graph" not in (a or {}) for a in section["server_args"].values())
    keys["sglang_plain_tokens_per_s_c1"] = (section["modes"]["plain"].get("1") or {}).get("tokens_per_s")
    return keys


def conversations_of(prompt_sets: dict[str, list[Any]]) -> dict[str, list[tuple]]:
    """``{category: [Prompt]}`` as plain data for a Ray task: ``{category: [(id, turns)]}``,
    ``(id, turns, answers)`` for a prompt with a fixed history, ``(id, turns, None, messages, tools)`` for
    a chat record."""
    def plain(p: Any) -> tuple:
        if p.messages is not None:
            return p.id, list(p.turns), None, p.messages, p.tools
        return (p.id, list(p.turns)) + ((list(p.answers),) if p.answers is not None else ())

    return {cat: [plain(p) for p in prompts] for cat, prompts in prompt_sets.items()}


def _prompt(category: str, prompt_id: str, texts: list[str], given: list) -> Prompt:
    """The Prompt behind one ``conversations_of`` tuple."""
    answers, messages, tools = (list(given) + [None, None, None])[:3]
    return Prompt(prompt_id, category, texts, answers=answers, messages=messages, tools=tools)


def modes_to_run(bench: BenchConfig) -> list[str]:
    return ["plain", *[m for m in SPEC_MODES if m in bench.modes]]
