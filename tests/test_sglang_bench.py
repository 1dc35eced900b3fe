"""The SGLang benchmark's orchestration and arithmetic (bench/sglang_bench.py, bench/sglang_runner.py).

The real ``sglang.Engine`` needs CUDA GPUs, so the engine here is a FAKE with its interface (an
asyncio ``loop``, ``async_generate(input_ids=, sampling_params=)`` answering ``output_ids`` and the
``meta_info`` counters SGLang fills, ``shutdown``); the contract suite pins those names against
SGLang's real source (tests/sglang_contract). Everything else is real: the config, the tokenizer and
chat template of the tiny target, the turn planning, the concurrency, the summaries and the report.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from eagle3_ray.bench import sglang_bench as sb
from eagle3_ray.bench import sglang_runner
from eagle3_ray.bench.prompts import Prompt
from eagle3_ray.bench.report import write_report
from eagle3_ray.config import PipelineConfig
from eagle3_ray.errors import EngineError

DRAFTS = {"chain": 3, "tree": 5}  # drafts the fake accepts per verify step at most, by mode


class FakeSGLangEngine:
    """FAKE ``sglang.Engine``. Greedy answers are a function of the prompt ids alone (so every mode
    answers a prompt alike, as lossless speculative decoding must); with ``speculative_algorithm`` it
    fills ``spec_verify_ct`` and ``spec_correct_drafts_histogram`` as SGLang does (every verify
    step accepts ``accept`` drafts, the first token comes from the prefill). Each decode step sleeps,
    so requests in flight overlap as a server's do."""

    instances: list["FakeSGLangEngine"] = []
    server_args_fields = frozenset({"cuda_graph_max_bs_decode"})

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.loop = asyncio.new_event_loop()
        self.calls = 0
        self.in_flight = self.most_in_flight = 0
        self.closed = False
        FakeSGLangEngine.instances.append(self)

    async def async_generate(self, input_ids, sampling_params):
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        n = min(sampling_params["max_new_tokens"], 5 + sum(input_ids) % 11)
        out = [(sum(input_ids) + i) % 97 for i in range(n)]
        meta = {"completion_tokens": n, "id": f"r{self.calls}"}
        spec = self.kwargs.get("speculative_algorithm") == "EAGLE3"
        if spec:
            accept = min(2, self.kwargs["speculative_num_draft_tokens"] - 1)
            steps, hist = 0, [0] * self.kwargs["speculative_num_draft_tokens"]
            left = n - 1
            while left > 0:
                steps += 1
                took = min(accept + 1, left)
                hist[took - 1] += 1
                left -= took
            if steps:
                meta.update(spec_verify_ct=steps, spec_correct_drafts_histogram=hist)
        await asyncio.sleep(0.0005 * (steps if spec else n))
        self.in_flight -= 1
        return {"output_ids": out, "meta_info": meta}

    def shutdown(self):
        self.closed = True
        self.loop.close()


def _cfg(**bench) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "target": {"model": "random:builtin:tiny-llama", "backend": "sglang", "device": "cpu"},
        "bench": {"max_new_tokens": 12, "num_steps": 3, "topk": 2, "depth": 3, "total_tokens": 6,
                  "concurrency": [1, 4], "engine": "sglang", **bench},
    })


CONVERSATIONS = {"writing": [("w1", ["Write a haiku.", "Now a longer one."]), ("w2", ["Hello!"])],
                 "math": [("m1", ["What is 2 + 2?", "And times 3?"])]}


def _parts(cfg: PipelineConfig) -> dict:
    FakeSGLangEngine.instances.clear()
    plain = sb.run_mode(cfg, "plain", "/drafter", CONVERSATIONS, factory=FakeSGLangEngine)
    turns = [sb.TurnPrompt(**t) for t in plain["turns"]]
    parts = {"plain": plain}
    for mode in ("chain", "tree"):
        parts[mode] = sb.run_mode(cfg, mode, "/drafter", turns=turns, factory=FakeSGLangEngine)
    return parts


def test_every_mode_answers_the_turns_plain_decoding_planned():
    cfg = _cfg()
    parts = _parts(cfg)
    plain = parts["plain"]
    # 5 turns; the second turn's prompt holds the plain engine's first answer (longer than turn 1's)
    assert [(t["category"], t["prompt_id"], t["turn"]) for t in plain["turns"]] == [
        ("writing", "w1", 0), ("writing", "w1", 1), ("writing", "w2", 0), ("math", "m1", 0), ("math", "m1", 1)]
    first, second = plain["turns"][0]["ids"], plain["turns"][1]["ids"]
    assert second[: len(first) - 1] == first[:-1] and len(second) > len(first) + 3
    engines = FakeSGLangEngine.instances
    assert [e.kwargs.get("speculative_eagle_topk") for e in engines] == [None, 1, 2]
    assert [e.kwargs.get("speculative_num_draft_tokens") for e in engines] == [None, 4, 6]
    assert all(e.closed for e in engines)  # every engine shut down
    assert max(e.most_in_flight for e in engines) == 4  # concurrency 4 really had 4 in flight
    # the same turns in every mode: each mode's concurrency-1 outputs equal plain's (the fake is greedy)
    section = sb.combine(parts, cfg.bench.concurrency)
    assert section["identical_to_plain"] == {"chain": 1.0, "tree": 1.0}
    assert section["num_turns"] == 5 and section["num_prompts"] == 3


def test_fixed_answers_are_the_history_of_the_planned_turns():
    """A conversation with fixed answers: the second turn's prompt holds the given answer, not the plain
    engine's reply, and every mode decodes those turns."""
    cfg = _cfg(concurrency=[1])
    convs = {"writing": [("w1", ["Write a haiku.", "Now a longer one."], ["Quiet pond."])]}
    plain = sb.run_mode(cfg, "plain", "/drafter", convs, factory=FakeSGLangEngine)
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.engines.describe import load_tokenizer

    tok = load_tokenizer(cfg.target)
    want = render_generation_prompt(tok, [{"role": "user", "content": "Write a haiku."},
                                          {"role": "assistant", "content": "Quiet pond."},
                                          {"role": "user", "content": "Now a longer one."}])
    assert plain["turns"][1]["ids"] == want
    assert sb.conversations_of({"writing": [Prompt("w1", "writing", ["a", "b"], answers=["x"])]}) == {
        "writing": [("w1", ["a", "b"], ["x"])]}
    assert sb.conversations_of({"writing": [Prompt("w2", "writing", ["a"])]}) == {"writing": [("w2", ["a"])]}


def test_counters_give_tau_histogram_and_speedups():
    cfg = _cfg()
    section = sb.combine(_parts(cfg), cfg.bench.concurrency)
    chain = section["modes"]["chain"]["1"]
    # each verify step appends 3 tokens (2 drafts + bonus) except a shorter last one
    assert 2.0 < chain["tau"] <= 3.0
    assert chain["accept_length"] > chain["tau"]  # SGLang's own counts the prefill's token too
    assert sum(chain["accept_histogram"]) == chain["verify_steps"]
    assert chain["accept_by_position"][0] == pytest.approx(1 - chain["accept_histogram"][0] / chain["verify_steps"])
    assert chain["ms_per_cycle"] > 0 and section["modes"]["chain"]["4"]["ms_per_cycle"] is None
    for mode in ("chain", "tree"):
        for c in ("1", "4"):
            want = section["modes"][mode][c]["tokens_per_s"] / section["modes"]["plain"][c]["tokens_per_s"]
            assert section["speedup"][mode][c] == pytest.approx(want)
    assert set(section["per_category"]) == {"writing", "math"} and set(section["per_turn"]) == {"1", "2"}
    assert section["per_category"]["math"]["plain"]["speedup"] == 1.0
    keys = sb.summary_keys(section, {"chain": 2.0, "tree": None})
    assert keys["sglang_vs_own_tau_diff_chain"] == pytest.approx(chain["tau"] - 2.0)
    assert keys["sglang_vs_own_tau_diff_tree"] is None and keys["sglang_cuda_graphs"] is True
    assert keys["sglang_spec_vs_plain_tree_c4"] == section["speedup"]["tree"]["4"]


@pytest.mark.parametrize("curve, says", [
    ({1: 1.8, 8: 1.3, 32: 1.05}, "above 1 at every measured concurrency (1.05x at 32)"),
    ({1: 0.9, 8: 0.7}, "below 1 at every measured concurrency (0.90x at 1)"),
    ({1: 2.0, 8: 1.5, 32: 0.5}, "crosses 1 between concurrency 8 (1.50x) and 32 (0.50x), near 16"),
])
def test_where_the_speedup_crosses_one(curve, says):
    assert sb.crossing(curve) == says


def test_cuda_graph_settings_of_each_mode():
    cfg = _cfg(concurrency=[1, 8, 32])
    fields = FakeSGLangEngine.server_args_fields
    for mode in ("plain", "chain", "tree"):
        kw = sb.mode_kwargs(cfg, mode, "/drafter", fields)
        assert "disable_cuda_graph" not in kw and kw["cuda_graph_max_bs_decode"] == 32
    assert "cuda_graph_max_bs_decode" not in sb.mode_kwargs(cfg, "plain", "/drafter", frozenset())
    off = sb.mode_kwargs(_cfg(cuda_graphs=False), "chain", "/drafter", fields)
    assert off["disable_cuda_graph"] is True and off["speculative_eagle_topk"] == 1
    own = _cfg(concurrency=[1, 8])
    own.target.sglang.extra_engine_kwargs["cuda_graph_max_bs_decode"] = 4
    assert sb.mode_kwargs(own, "tree", "/drafter", fields)["cuda_graph_max_bs_decode"] == 4  # the user's


def test_bench_config_refuses_bad_concurrency():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="distinct request counts"):
        _cfg(concurrency=[1, 1])
    with pytest.raises(ValidationError, match="distinct request counts"):
        _cfg(concurrency=[0, 8])
    assert _cfg(concurrency=[32, 1]).bench.concurrency == [1, 32]
    assert PipelineConfig().bench.bench_engine("hf") == "hf"
    assert _cfg().bench.bench_engine("hf") == "sglang"


def test_runner_resumes_modes_and_reports_a_failed_mode(tmp_path, monkeypatch):
    """The Ray layer's bookkeeping: each measured mode saved at once, a rerun measures only what is
    missing, a spec mode that fails is recorded and the other modes still reported, then an error."""
    cfg = _cfg()
    ran: list[str] = []
    fail = {"tree"}

    def run_task(cfg, mode, drafter_dir, conversations, turns):  # the Ray task, run in-process
        ran.append(mode)
        if mode in fail:
            raise RuntimeError("Traceback ...\nModuleNotFoundError: No module named 'deep_gemm'")
        return sb.run_mode(cfg, mode, drafter_dir, conversations, turns, factory=FakeSGLangEngine)

    monkeypatch.setattr(sglang_runner, "_run_task", run_task)
    sets = {cat: [Prompt(pid, cat, turns) for pid, turns in convs] for cat, convs in CONVERSATIONS.items()}
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    with pytest.raises(EngineError, match="tree: ModuleNotFoundError: No module named 'deep_gemm'"):
        sglang_runner.sglang_only_results(cfg, str(drafter), sets, tmp_path)
    assert ran == ["plain", "chain", "tree"]
    assert sorted(p.name for p in (tmp_path / "partial").iterdir()) == ["sglang-chain.json", "sglang-plain.json"]
    fail.clear()
    results = sglang_runner.sglang_only_results(cfg, str(drafter), sets, tmp_path)
    assert ran == ["plain", "chain", "tree", "tree"]  # plain and chain read back
    assert results["sglang"]["errors"] == {} and results["tau"]["tree"] > 1
    assert results["summary"]["sglang_tau_chain"] == results["tau"]["chain"]
    json.dumps(results)  # results.json-able, with no per-request output ids in it
    assert "output_ids" not in json.dumps(results)
    text = write_report(results, tmp_path).read_text()
    assert "## SGLang: EAGLE-3 against SGLang's plain decoding" in text
    assert "| chain | 4 |" in text and "Acceptance histogram at concurrency 1" in text
    assert "CUDA graphs on in every engine" in text


def test_a_bench_without_concurrency_1_reports_its_lowest_concurrency(tmp_path, monkeypatch):
    """bench.concurrency=[4]: the summary and headline are concurrency 4's (not "nothing was decoded"),
    and no per-turn or per-category table of plain decoding alone (those are concurrency-1 figures)."""
    cfg = _cfg(concurrency=[4])
    monkeypatch.setattr(sglang_runner, "_run_task", lambda cfg, mode, drafter_dir, conversations, turns:
                        sb.run_mode(cfg, mode, drafter_dir, conversations, turns, factory=FakeSGLangEngine))
    sets = {cat: [Prompt(pid, cat, turns) for pid, turns in convs] for cat, convs in CONVERSATIONS.items()}
    (tmp_path / "drafter").mkdir()
    results = sglang_runner.sglang_only_results(cfg, str(tmp_path / "drafter"), sets, tmp_path)
    assert results["summary_concurrency"] == 4
    assert results["speedup"]["chain"] == results["sglang"]["speedup"]["chain"]["4"] is not None
    assert results["per_turn"] == {} and results["per_category"] == {}
    text = write_report(results, tmp_path).read_text()
    assert "nothing was decoded" not in text and "4 requests in flight" in text
    assert "At concurrency 4 (the lowest measured" in text and "## Per category" not in text


class HangingEngine(FakeSGLangEngine):
    """FAKE engine that starts and then never answers (what a hung SGLang scheduler looks like)."""

    async def async_generate(self, input_ids, sampling_params):
        await asyncio.sleep(3600)


def test_an_engine_that_stops_answering_ends_the_mode_with_an_error(monkeypatch):
    monkeypatch.setattr(sb, "STALL_S", 1.0)
    began = __import__("time").monotonic()
    with pytest.raises(EngineError, match=r"the SGLang plain engine of the bench answered nothing for 1 s"):
        sb.run_mode(_cfg(), "plain", "/drafter", CONVERSATIONS, factory=HangingEngine)
    assert __import__("time").monotonic() - began < 30
    assert FakeSGLangEngine.instances[-1].closed  # shut down on the way out


def test_a_dead_engine_process_ends_the_wait(monkeypatch):
    """A real child process stands for the scheduler: killed mid-call, the wait ends at once."""
    import subprocess

    from eagle3_ray.engines import sglang_process as sp

    monkeypatch.setattr(sp, "LIVENESS_POLL_S", 0.1)
    scheduler = subprocess.Popen(["sleep", "60"])
    engine = HangingEngine()
    loop = sp.EngineLoop(engine, {scheduler.pid}, "the test engine")
    try:
        import threading

        threading.Timer(0.5, scheduler.kill).start()
        with pytest.raises(sp.EngineDied, match=rf"the test engine: SGLang processes \[{scheduler.pid}\] exited"):
            loop.call(engine.async_generate([1], {"max_new_tokens": 1}))
    finally:
        loop.close()
        scheduler.wait()


def test_a_chat_record_is_planned_after_its_own_replies_and_tools():
    """A chat record (agentic): its second turn is asked after the record's call, result and answer, with
    its tools; its plain-data form carries the messages and tools to the Ray task."""
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.data.messages import conversation
    from eagle3_ray.engines.describe import load_tokenizer

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages, tools = conversation([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "-4"},
        {"role": "assistant", "content": "Minus four."},
        {"role": "user", "content": "And tomorrow?"}], tools)
    prompt = Prompt("a1", "agent", ["Weather in Oslo?", "And tomorrow?"], messages=messages, tools=tools)
    convs = sb.conversations_of({"agent": [prompt]})
    assert convs == {"agent": [("a1", prompt.turns, None, messages, tools)]}
    cfg = _cfg(concurrency=[1])
    plain = sb.run_mode(cfg, "plain", "/drafter", convs, factory=FakeSGLangEngine)
    assert plain["turns"][1]["ids"] == render_generation_prompt(load_tokenizer(cfg.target), messages, tools)
