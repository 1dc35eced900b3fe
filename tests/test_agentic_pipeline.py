"""The shipped agentic set through `eagle3-ray run`'s stages, mixed with ci-tiny's conversations as a run mixes
it into its own data (data.path as a list): generate answers the conversations that end on tool results and
copies the rest, prepare masks what the target generates. The run stops there: what extract and train read
is the prepared rows, whatever conversations they came from. The ci-tiny target (seeded random tiny Llama,
SmolLM2 tokenizer and template) keeps it cheap."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from eagle3_ray.config import load_config
from eagle3_ray.data.sources import Sample, read_samples

# Sampled: the random target's greedy replies here are special tokens only, which decode to empty text.
MIX = ["data.path=[builtin:ci_tiny, builtin:demo_agentic]", "generate.max_new_tokens=8", "generate.temperature=1.0"]


@pytest.fixture(scope="module")
def agentic_run(ray_local, tmp_path_factory):
    from eagle3_ray.pipeline import run_pipeline

    out = tmp_path_factory.mktemp("agentic") / "run"
    run_pipeline(load_config("configs/ci-tiny.yaml", MIX), data=None, out=out, stop_after="prepare")
    return out


def test_generate_writes_replies_to_tool_results_and_copies_the_rest(agentic_run):
    given = {s.sample_id: s for s in read_samples("builtin:demo_agentic")}
    lines = (agentic_run / "generate" / "conversations.jsonl").read_text(encoding="utf-8").splitlines()
    written = [json.loads(line) for line in lines]
    assert len(written) == 12 + 36
    by_id = {r["id"]: r for r in written}
    for sid, sample in given.items():
        conv = by_id[sid]["conversations"]
        assert by_id[sid]["tools"] == sample.tools
        if sample.needs_generation:  # the reply to the tool results: the target's, after the given turns
            assert conv[:-1] == sample.messages and conv[-1]["role"] == "assistant" and conv[-1]["content"]
        else:
            assert conv == sample.messages
    summary = json.loads((agentic_run / "generate" / "summary.json").read_text())
    assert summary["conversations"] == 48 and summary["rejected"] == 0


def test_prepare_masks_the_targets_turns_and_never_the_tool_results(agentic_run):
    from transformers import AutoTokenizer

    from eagle3_ray.engines.describe import tokenizer_path_for

    table = pq.read_table(agentic_run / "prepare" / "prepared.parquet").to_pylist()
    assert len(table) == 48
    tok = AutoTokenizer.from_pretrained(tokenizer_path_for(load_config("configs/ci-tiny.yaml").target))
    conversations = {s.sample_id: s for s in read_samples(agentic_run / "generate" / "conversations.jsonl")}
    for row in table:
        if not row["sample_id"].startswith("agent-"):
            continue
        sample: Sample = conversations[row["sample_id"]]
        masked = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
        unmasked = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if not m])
        assert masked.count("<|im_end|>") == sum(m["role"] == "assistant" for m in sample.messages)
        for m in sample.messages:
            if m["role"] in ("tool", "user", "system"):
                assert m["content"] in unmasked, (row["sample_id"], m)
