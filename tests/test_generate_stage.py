"""The generate stage: the order its actors answer prompts in (by turns, then prompt length, so a
batched decoder gets batches of alike prompts), the prompts it rejects as too long for
data.max_length, and the driver's join back into input order; more answers per prompt
(generate.samples_per_prompt: sampled copies under ids <id>#s<copy>), and requests the target writes
itself (generate.synthetic_prompts). The actor runs here as a plain object on the real HF engine
(seeded random tiny Llama, SmolLM2 tokenizer; the real SmolLM2 for the requests it writes); one test
runs the stage through Ray."""

from __future__ import annotations

import json

import pytest

from eagle3_ray.config import GenerateConfig, TargetConfig
from eagle3_ray.data.chat import render_generation_prompt
from eagle3_ray.data.sources import Sample
from eagle3_ray.data.distill import self_distill
from eagle3_ray.errors import DataError
from eagle3_ray.data.synthetic import MAX_CALLS_PER_BATCH, SYNTHETIC_MAX_TOKENS, synthetic_prompts, user_header_ids
from eagle3_ray.data.groups import base_id, copy_id
from eagle3_ray.extract.generate_stage import (
    COPY_SEED_STRIDE,
    DistillActor, SyntheticShare, check_copy_ids, generation_order, join_in_order, joined_order, synthetic_seed,
)

TARGET = TargetConfig(model="random:builtin:tiny-llama", device="cpu", dtype="float32")
GEN = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "batch_size": 2, "seed": 0}


def _gen(**changes) -> GenerateConfig:
    """The generate section of these tests: GEN with ``changes``."""
    return GenerateConfig(**{**GEN, **changes})


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _samples() -> list[Sample]:
    """Input order deliberately not by length. "mid" is shorter than "short" as rendered: the template
    adds its default system prompt where a sample has none."""
    return [
        Sample("long", [_user("Tell me everything about the history of " + "the old city walls, " * 12)], "t"),
        Sample("short", [_user("Hi?")], "t"),
        Sample("two-turns", [_user("Name a color."), _user("Another one?")], "t"),
        Sample("answered", [_user("Hi"), {"role": "assistant", "content": "Hello!"}], "t"),
        Sample("mid", [{"role": "system", "content": "Be brief."}, _user("What is a prime number?")], "t"),
        Sample("huge", [_user("word " * 600)], "t"),
    ]


@pytest.fixture(scope="module")
def actor():
    a = DistillActor(TARGET, 256)
    yield a
    a.close()


class Recording:
    """Passes generate calls to the real engine, remembering each call's prompts."""

    def __init__(self, inner):
        self.inner, self.info, self.calls, self.sampling = inner, inner.info, [], []

    def generate(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        self.calls.append([list(p) for p in prompts])
        self.sampling.append((temperature, top_p, seed))
        return self.inner.generate(prompts, max_new_tokens, temperature, top_p, seed)


def test_order_is_turns_then_prompt_length_and_too_long_prompts_are_rejected(actor):
    tok = actor.tokenizer
    samples = _samples()
    ordered, rejects = generation_order(samples, tok, max_length=256)
    assert [s.sample_id for s in ordered] == ["answered", "mid", "short", "long", "two-turns"]
    assert [(r["sample_id"], r["stage"]) for r in rejects] == [("huge", "generate")]
    n = len(render_generation_prompt(tok, samples[-1].messages))
    assert f"the prompt has {n} tokens, data.max_length=256" in rejects[0]["reason"]
    # Stable and the same on a rerun (resume relies on it); no limit rejects nothing.
    assert [s.sample_id for s in generation_order(samples[::-1], tok, 256)[0]] == [
        "answered", "mid", "short", "long", "two-turns"]
    everything, none = generation_order(samples, tok)
    assert none == [] and everything[-2].sample_id == "huge"


def test_actor_feeds_the_engine_batches_of_alike_prompts(actor, tmp_path):
    tok = actor.tokenizer
    inner = actor.engine
    actor.engine = rec = Recording(inner)
    try:
        part = tmp_path / "part.jsonl"
        summary = actor.run(_samples(), str(part), _gen(), max_length=256)
    finally:
        actor.engine = inner
    # Batches of 2 in length order: (answered, mid) -> mid alone is asked, then (short, long),
    # then the two-turn sample's two turns; the input order would have mixed turns and lengths.
    lengths = [[len(p) for p in call] for call in rec.calls]
    first_turn = {s.sample_id: len(render_generation_prompt(tok, s.messages[:2] if s.messages[0]["role"] == "system"
                                                            else s.messages[:1])) for s in _samples()}
    assert lengths[:3] == [[first_turn["mid"]], [first_turn["short"], first_turn["long"]], [first_turn["two-turns"]]]
    assert len(rec.calls) == 4  # + the second turn of the two-turn sample
    assert [r["sample_id"] for r in summary["rejected"]] == ["huge"]
    written = [json.loads(line)["id"] for line in part.read_text().splitlines()]
    assert written == ["answered", "mid", "short", "long", "two-turns"]
    # The driver's join puts them back in input order.
    joined = tmp_path / "joined.jsonl"
    with open(joined, "wb") as f:
        assert join_in_order([part], [s.sample_id for s in _samples()], f) == 5
    assert [json.loads(line)["id"] for line in joined.read_text().splitlines()] == [
        "long", "short", "two-turns", "answered", "mid"]


def test_join_orders_across_parts_and_keeps_unknown_records_last(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"id": "x3", "conversations": []}\n{"id": "x1", "conversations": []}\n\n')
    b.write_text('{"id": "stray", "conversations": []}\n{"id": "x2", "conversations": []}\n')
    out = tmp_path / "out.jsonl"
    with open(out, "wb") as f:
        assert join_in_order([a, b], ["x1", "x2", "x3"], f) == 4
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["x1", "x2", "x3", "stray"]


def test_generate_stage_rejects_long_prompts_and_writes_input_order(ray_local, tmp_path):
    from eagle3_ray.config import load_config
    from eagle3_ray.extract.generate_stage import run_generate

    data = tmp_path / "prompts.jsonl"
    records = [{"id": s.sample_id, "conversations": s.messages} for s in _samples()]
    records[2] = {"id": "two-turns", "turns": [m["content"] for m in _samples()[2].messages]}  # MT-bench style
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config("configs/ci-tiny.yaml", ["data.max_length=256", "generate.max_new_tokens=4"])
    joined = run_generate(cfg, str(data), tmp_path / "gen")
    ids = [json.loads(line)["id"] for line in joined.read_text().splitlines()]
    assert ids == ["long", "short", "two-turns", "answered", "mid"]
    rejects = [json.loads(line) for line in (tmp_path / "gen" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["sample_id"], r["stage"]) for r in rejects] == [("huge", "generate")]
    summary = json.loads((tmp_path / "gen" / "summary.json").read_text())
    assert (summary["conversations"], summary["rejected"]) == (5, 1)
    assert (summary["samples_per_prompt"], summary["conversations_per_copy"]) == (1, [5])

    # Two answers per prompt: each prompt-only sample's sampled copy follows its greedy answer, which
    # is the record of the run above byte for byte; the too-long prompt is rejected once.
    cfg2 = load_config("configs/ci-tiny.yaml", ["data.max_length=256", "generate.max_new_tokens=4",
                                                "generate.samples_per_prompt=2"])
    joined2 = run_generate(cfg2, str(data), tmp_path / "gen2")
    lines = joined2.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [
        "long", "long#s1", "short", "short#s1", "two-turns", "two-turns#s1", "answered", "mid", "mid#s1"]
    assert [line for line in lines if "#s1" not in json.loads(line)["id"]] == joined.read_text().splitlines()
    rejects = [json.loads(line) for line in (tmp_path / "gen2" / "rejects.jsonl").read_text().splitlines()]
    assert [r["sample_id"] for r in rejects] == ["huge"]
    summary = json.loads((tmp_path / "gen2" / "summary.json").read_text())
    assert (summary["conversations"], summary["rejected"]) == (9, 1)
    assert (summary["samples_per_prompt"], summary["conversations_per_copy"]) == (2, [5, 4])


def test_join_keeps_answers_with_unicode_line_separators_whole(tmp_path):
    """Answers are written with ensure_ascii=False, so U+2028 / U+2029 / U+0085 stand raw inside a
    record: the join splits at "\\n" only (str.splitlines would cut the record and fail to parse it)."""
    from eagle3_ray.data.distill import _append  # the writer of the actors' part files

    answer = "line one\u2028line two\u2029para\x85next\x1cend"
    part = tmp_path / "p.jsonl"
    with open(part, "w", encoding="utf-8") as f:
        _append(f, [{"id": "u1", "conversations": [{"role": "assistant", "content": answer}]}])
    assert "\u2028" in part.read_text(encoding="utf-8")
    out = tmp_path / "out.jsonl"
    with open(out, "wb") as f:
        assert join_in_order([part], ["u1"], f) == 1
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").split("\n") if x.strip()]
    assert rows[0]["conversations"][0]["content"] == answer


def test_one_answer_per_prompt_writes_what_the_stage_wrote_before_copies(actor, tmp_path):
    """samples_per_prompt=1 (and a gen dict without the key): the part file is byte for byte what the
    actor wrote before copies existed (generation order, then one self_distill call)."""
    samples = _samples()
    before = tmp_path / "before.jsonl"
    ordered, _ = generation_order(samples, actor.tokenizer, 256)
    self_distill(actor.engine, actor.tokenizer, ordered, before, max_new_tokens=4, temperature=0.0, top_p=1.0,
                 batch_size=2, seed=0, answered_by=actor.fingerprint)  # the actor marks its greedy answers
    for i, gen in enumerate([_gen(), _gen(samples_per_prompt=1, sample_temperature=0.7)]):
        part = tmp_path / f"part{i}.jsonl"
        summary = actor.run(samples, str(part), gen, max_length=256)
        assert part.read_bytes() == before.read_bytes()
        assert [c["total"] for c in summary["per_copy"]] == [5] and summary["generated"] == 4


def test_sampled_copies_follow_copy_zero_in_generation_order_and_resume(actor, tmp_path):
    inner = actor.engine
    actor.engine = rec = Recording(inner)
    gen = _gen(samples_per_prompt=3, sample_temperature=0.7, top_p=0.9, seed=5)
    part = tmp_path / "part.jsonl"
    try:
        summary = actor.run(_samples(), str(part), gen, max_length=256)
    finally:
        actor.engine = inner
    written = [json.loads(line)["id"] for line in part.read_text().splitlines()]
    order = ["mid", "short", "long", "two-turns"]  # prompt-only, generation order; "answered" is not copied
    assert written == ["answered", *order, *[f"{i}#s1" for i in order], *[f"{i}#s2" for i in order]]
    assert [r["sample_id"] for r in summary["rejected"]] == ["huge"]  # once, not per copy
    assert [c["total"] for c in summary["per_copy"]] == [5, 4, 4] and summary["generated"] == 12
    # Copy 0 at generate.temperature (greedy), copy c at sample_temperature from copy_seed(seed, c) (+1 a
    # call, as self_distill counts): copy 0 makes 4 calls (batches of 2 with "answered" first, the
    # two-turn sample's second turn), each sampled copy 3 (no "answered"). No seed is used twice.
    assert [t for t, _, _ in rec.sampling] == [0.0] * 4 + [0.7] * 6
    s = COPY_SEED_STRIDE
    assert [seed for _, _, seed in rec.sampling] == [5, 6, 7, 8, 5 + s, 6 + s, 7 + s, 5 + 2 * s, 6 + 2 * s, 7 + 2 * s]
    assert len({seed for _, _, seed in rec.sampling}) == len(rec.sampling)
    assert {p for _, p, _ in rec.sampling} == {0.9}
    # A rerun answers nothing again: every copy resumes by id from the one part file.
    again = actor.run(_samples(), str(part), gen, max_length=256)
    assert again["generated"] == 0 and [c["skipped"] for c in again["per_copy"]] == [5, 4, 4]
    assert [json.loads(line)["id"] for line in part.read_text().splitlines()] == written


def test_copy_ids_and_their_collisions_with_input_ids():
    assert [copy_id("q7", c) for c in range(3)] == ["q7", "q7#s1", "q7#s2"]
    assert joined_order(["q", "synthetic:0:000000"], 2) == ["q", "q#s1", "synthetic:0:000000", "synthetic:0:000000#s1"]
    assert [base_id(i) for i in ["q7", "q7#s1", "q7#s12", "a#s1#s2", "a#sx", "a#s", "a#s1b", "file-3"]] == [
        "q7", "q7", "q7", "a#s1", "a#sx", "a#s", "a#s1b", "file-3"]
    given = [Sample("a", [_user("x")], "f:1"), Sample("a#s1", [_user("y")], "f:2"),
             Sample("b", [_user("Hi"), {"role": "assistant", "content": "Hello"}], "f:3"),
             Sample("b#s1", [_user("z")], "f:4")]
    check_copy_ids(given, 1)  # no copies: any ids
    with pytest.raises(DataError, match=r"f:2 has the id 'a#s1'.*copy 1 of 'a'.*samples_per_prompt=1"):
        check_copy_ids(given, 2)
    check_copy_ids(given[2:], 3)  # "b" is answered already: it has no copies, "b#s1" is free


class ScriptedEngine:
    """A fake of the project's own TargetEngine (its ``generate`` only), returning given token lists
    batch by batch and recording every call: a target whose requests are known, to test the
    filtering (the real SmolLM2 writes requests in the test after this one)."""

    def __init__(self, batches: list[list[list[int]]]):
        self.batches, self.calls = list(batches), []

    def generate(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        self.calls.append(([list(p) for p in prompts], max_new_tokens, temperature, top_p, seed))
        return self.batches.pop(0) if self.batches else [[] for _ in prompts]


def test_synthetic_requests_keep_ended_new_ones_and_resume_from_their_file(actor, tmp_path):
    tok = actor.tokenizer
    header = user_header_ids(tok)
    assert tok.decode(header).endswith("<|im_start|>user\n")  # SmolLM2's template, its default system prompt first

    def said(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    unended = [5] * SYNTHETIC_MAX_TOKENS
    plants, poem = "How do plants make food?", "Write a poem about the sea."
    recursion = "Explain recursion, with an example."
    eng = ScriptedEngine([[said(plants), said("Hi there"), unended, said(plants)],  # short, cut, repeated: dropped
                          [said(poem), said(recursion), said("One more request here."), []]])
    path = tmp_path / "synthetic.part-003.jsonl"
    got = synthetic_prompts(eng, tok, 2, path, actor=3, batch_size=4, seed=7)
    assert [s.sample_id for s in got] == ["synthetic:3:000000", "synthetic:3:000001"]
    assert [s.messages for s in got] == [[_user(plants)], [_user(poem)]]
    assert all(s.needs_generation for s in got)
    assert [(len(p), n, t, top_p, seed) for p, n, t, top_p, seed in eng.calls] == [
        (4, SYNTHETIC_MAX_TOKENS, 1.0, 0.98, 7), (4, SYNTHETIC_MAX_TOKENS, 1.0, 0.98, 8)]
    assert all(p == header for prompts, *_ in eng.calls for p in prompts)
    # A rerun reads the file back and asks the engine nothing: the same requests get answered.
    again = ScriptedEngine([])
    assert synthetic_prompts(again, tok, 2, path, actor=3, batch_size=4) == got and again.calls == []
    # A target that never ends a turn costs a bounded number of calls and gives no request.
    never = ScriptedEngine([[unended] * 4] * 100)
    assert synthetic_prompts(never, tok, 5, tmp_path / "none.jsonl", batch_size=4) == []
    assert len(never.calls) == MAX_CALLS_PER_BATCH * 2
    assert synthetic_seed(0, 1) - synthetic_seed(0, 0) == COPY_SEED_STRIDE


def test_smollm2_writes_requests_and_answers_them(tmp_path):
    """The real SmolLM2 writes user requests from its template's header (sampled), which the actor then
    answers with the input's prompts, into the same part file; a rerun answers nothing again."""
    a = DistillActor(TargetConfig(model="smollm2", device="cpu", dtype="float32"), 256)
    try:
        part, syn = tmp_path / "part.jsonl", tmp_path / "synthetic.part-000.jsonl"
        gen = _gen(max_new_tokens=6, batch_size=4)
        synthetic = SyntheticShare(count=3, path=str(syn), actor=0)
        summary = a.run([_samples()[1]], str(part), gen, max_length=256, synthetic=synthetic)
        requests = [json.loads(line) for line in syn.read_text().splitlines()]
        assert summary["synthetic"] == len(requests) >= 1
        records = {r["id"]: r["conversations"] for r in map(json.loads, part.read_text().splitlines())}
        assert set(records) == {"short"} | {r["id"] for r in requests}
        for r in requests:
            assert len(r["prompt"].split()) >= 4 and "<|im" not in r["prompt"]
            user, answer = records[r["id"]]
            assert user == _user(r["prompt"]) and answer["role"] == "assistant" and answer["content"]
        again = a.run([_samples()[1]], str(part), gen, max_length=256, synthetic=synthetic)
        assert again["generated"] == 0 and again["synthetic"] == summary["synthetic"]
    finally:
        a.close()


def test_synthetic_ids_may_not_be_taken_by_the_input(tmp_path):
    from eagle3_ray.config import load_config
    from eagle3_ray.extract.generate_stage import run_generate

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "synthetic:0:000000", "turns": ["Hi?"]}) + "\n")
    cfg = load_config("configs/ci-tiny.yaml", ["generate.synthetic_prompts=2"])
    with pytest.raises(DataError, match=r"ids starting 'synthetic:'.*generate.synthetic_prompts=0"):
        run_generate(cfg, str(data), tmp_path / "gen")


def test_a_rerun_under_other_answer_settings_refuses_to_resume_the_old_answers(tmp_path):
    """The part files resume by id; answers written under another target, temperature, length or
    seed must not be mixed into a rerun: the stage refuses, says which settings changed and what to
    delete; settings that do not change an answer (batch size, more copies) resume."""
    from eagle3_ray.config import load_config
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.extract.generate_stage import ANSWERS_META, answer_settings, check_answer_settings, run_generate

    out = tmp_path / "gen"
    out.mkdir()
    cfg = load_config("configs/ci-tiny.yaml", ["generate.max_new_tokens=4"])
    check_answer_settings(out, answer_settings(cfg))  # a first run: records the settings
    assert json.loads((out / ANSWERS_META).read_text())["generate.max_new_tokens"] == 4
    (out / "conversations.part-000.jsonl").write_text(json.dumps({"id": "a", "conversations": []}) + "\n")
    for same in (["generate.batch_size=3"], ["generate.samples_per_prompt=3"], ["generate.synthetic_prompts=5"]):
        check_answer_settings(out, answer_settings(load_config("configs/ci-tiny.yaml",
                                                               ["generate.max_new_tokens=4", *same])))
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "a", "turns": ["Hi?"]}) + "\n")
    other = load_config("configs/ci-tiny.yaml", ["generate.max_new_tokens=8", "generate.temperature=0.5"])
    with pytest.raises(ConfigError, match=r"generate.max_new_tokens=4 then, 8 now; generate.temperature=0.0 then, "
                                          r"0.5 now.*delete .*conversations.part-\*.jsonl"):
        run_generate(other, str(data), out)  # refused before any actor starts
    (out / "conversations.part-000.jsonl").unlink()  # answers deleted: the new settings are recorded
    check_answer_settings(out, answer_settings(other))
    assert json.loads((out / ANSWERS_META).read_text())["generate.max_new_tokens"] == 8
    (out / "synthetic.part-000.jsonl").write_text("")  # the target's own requests count as answers too
    with pytest.raises(ConfigError, match="target.model"):
        check_answer_settings(out, answer_settings(load_config(
            "configs/ci-tiny.yaml", ["generate.max_new_tokens=8", "generate.temperature=0.5",
                                     "target.model=random:builtin:llama3.1-8b-shape"])))


def test_a_rerun_over_a_prompt_edited_under_its_id_refuses_to_resume_its_old_answer(tmp_path):
    """`eagle3-ray generate` on its own (run refuses earlier, tests/test_run_pipeline.py): the parts
    resume by id, so the input's content is recorded with the settings and an edited prompt stops
    the rerun before any actor starts, naming what changed."""
    from eagle3_ray.config import load_config
    from eagle3_ray.data.sources import file_fingerprint
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.extract.generate_stage import ANSWERS_META, answer_settings, check_answer_settings, run_generate

    cfg = load_config("configs/ci-tiny.yaml")
    out, data = tmp_path / "gen", tmp_path / "prompts.jsonl"
    out.mkdir()
    data.write_text(json.dumps({"id": "a", "turns": ["Name a prime."]}) + "\n")
    first = file_fingerprint(data)["sha256"]
    check_answer_settings(out, {**answer_settings(cfg), "input.sha256": first})  # as the first run recorded
    (out / "conversations.part-000.jsonl").write_text(json.dumps({"id": "a", "conversations": []}) + "\n")
    data.write_text(json.dumps({"id": "a", "turns": ["Name an even prime."]}) + "\n")
    with pytest.raises(ConfigError, match=rf"input.sha256='{first}' then, '[0-9a-f]{{64}}' now.*delete "):
        run_generate(cfg, str(data), out)
    assert json.loads((out / ANSWERS_META).read_text())["input.sha256"] == first


def test_answers_written_earlier_are_taken_where_the_settings_and_the_prompt_match(ray_local, tmp_path):
    """generate.answers: an earlier run's answers are taken for the prompts they answer (the record
    whose messages are the prompt's); an edited or a new prompt is answered here; other answer
    settings take none; a run whose every answer is taken starts no engine actor."""
    from eagle3_ray.config import load_config
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.extract.generate_stage import ANSWERS_META, CONVERSATIONS_FILE, run_generate

    data = tmp_path / "prompts.jsonl"
    prompts = [{"id": "a", "turns": ["Name a color."]}, {"id": "b", "turns": ["Hi?"]},
               {"id": "two", "turns": ["Name a prime.", "Another one?"]}]
    data.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    cfg = load_config("configs/ci-tiny.yaml", ["generate.max_new_tokens=4"])
    earlier = run_generate(cfg, str(data), tmp_path / "earlier")
    # Mark the earlier answers, so that an answer taken reads apart from one written again.
    records = [json.loads(line) for line in earlier.read_text().splitlines()]
    for r in records:
        for m in r["conversations"]:
            if m["role"] == "assistant":
                m["content"] = "EARLIER " + m["content"]
    earlier.write_text("".join(json.dumps(r) + "\n" for r in records))

    edited = [prompts[0], {"id": "b", "turns": ["Hello?"]}, prompts[2], {"id": "c", "turns": ["Why?"]}]
    data.write_text("".join(json.dumps(p) + "\n" for p in edited))
    taking = load_config("configs/ci-tiny.yaml", ["generate.max_new_tokens=4", f"generate.answers={earlier}"])
    joined = run_generate(taking, str(data), tmp_path / "now")
    answers = {r["id"]: [m["content"] for m in r["conversations"] if m["role"] == "assistant"]
               for r in map(json.loads, joined.read_text().splitlines())}
    assert [a.startswith("EARLIER ") for a in answers["a"] + answers["two"]] == [True] * 3
    assert not any(a.startswith("EARLIER ") for a in answers["b"] + answers["c"])  # edited, new: answered here
    assert json.loads((tmp_path / "now" / "summary.json").read_text())["answers_taken"] == 2

    data.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    everything = run_generate(taking, str(data), tmp_path / "all")
    summary = json.loads((tmp_path / "all" / "summary.json").read_text())
    assert summary["answers_taken"] == 3 and summary["parts"][0]["seconds"] == 0.0  # no actor was started
    assert everything.read_text() == earlier.read_text()

    longer = load_config("configs/ci-tiny.yaml", ["generate.max_new_tokens=5", f"generate.answers={earlier.parent}"])
    run_generate(longer, str(data), tmp_path / "longer")
    assert json.loads((tmp_path / "longer" / "summary.json").read_text())["answers_taken"] == 0

    # The dtype the answers were written in: an earlier "auto" as this CPU run resolves it (fp32, as
    # ci-tiny's float32); answers written in bf16 (a GPU's auto) are not this run's.
    meta = json.loads((earlier.parent / ANSWERS_META).read_text())
    for dtype, taken in (("auto", 3), ("bfloat16", 0)):
        (earlier.parent / ANSWERS_META).write_text(json.dumps({**meta, "target.dtype": dtype}))
        run_generate(taking, str(data), tmp_path / dtype)
        assert json.loads((tmp_path / dtype / "summary.json").read_text())["answers_taken"] == taken

    (earlier.parent / ANSWERS_META).unlink()
    with pytest.raises(ConfigError, match="answers_meta.json is missing.*as --data"):
        run_generate(taking, str(data), tmp_path / "no-meta")
    assert CONVERSATIONS_FILE == earlier.name
