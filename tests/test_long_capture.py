"""Long samples on CPU, from the tokenizer to the packed training row (docs/data.md, "Long samples").

- The HF engine captures an 8,192-token sample (SmolLM2's window, 4x the presets' 2,048) of a tiny
  random Llama with exactly one row per token, and its first 2,048 rows equal the capture of its first
  2,048 tokens; captured right-padded beside a 2K sample in one forward, neither sample's rows change.
- The prepare path (``tokenize_conversation`` and ``TokenizeUDF``, what the prepare stage maps) keeps a
  conversation of up to ``data.max_length`` tokens whole (the boundary exactly), and one token more is
  rejected with the reason, or, with ``data.truncate``, cut to its first ``max_length`` tokens (as
  docs/data.md says); ``configs/smollm2-long.yaml`` keeps 8,192.
- Online/hybrid training's capture actor (``PackCaptureUDF``, called in-process as
  tests/test_online.py calls it; Ray only moves its rows) packs the long sample whole, commits it
  whole to the hybrid store, and the worker's ``row_to_batch`` lays it out as one row of its own.

Rounding: the prefix rows are compared within 64 fp32 eps (float32 engine) and 4 bf16 eps (bfloat16
engine) of each row's largest magnitude, test_hf_engine.py's bound for captures whose matmuls have
other shapes than the reference's. Measured on this 2-core CPU: bit-identical (both dtypes alone, and
fp32 padded; the padded case runs in fp32 only, ~10 s).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eagle3_ray.config import TargetConfig, load_config
from eagle3_ray.data.chat import render, tokenize_conversation
from eagle3_ray.data.sources import Sample
from eagle3_ray.engines.hf import HFEngine
from eagle3_ray.errors import SampleRejected

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = 8192  # tokens of the long sample: SmolLM2's window (configs/smollm2-long.yaml data.max_length)
SHORT = 2048  # the presets' data.max_length
BOUND = {"float32": 64 * torch.finfo(torch.float32).eps, "bfloat16": 4 * torch.finfo(torch.bfloat16).eps}


@pytest.fixture(scope="module")
def long_target(tmp_path_factory, smollm2_dir) -> str:
    """The builtin tiny Llama with a window of LONG tokens (its own is 4,096): random:<config>."""
    from eagle3_ray.engines.targets import RESOURCES_DIR

    cfg = json.loads((RESOURCES_DIR / "tiny-llama.json").read_text())
    cfg["max_position_embeddings"] = LONG
    path = tmp_path_factory.mktemp("long_target") / "config.json"
    path.write_text(json.dumps(cfg))
    return f"random:{path}"


@pytest.fixture(scope="module")
def long_ids() -> list[int]:
    return torch.randint(0, 49152, (LONG,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request, long_target):
    eng = HFEngine(TargetConfig(model=long_target, seed=3, dtype=request.param), batch_tokens=2 * LONG, device="cpu")
    yield eng
    eng.close()


def _worst(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| over each row's largest |ref| (fp32 arithmetic)."""
    got, ref = got.float(), ref.float()
    scale = ref.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return ((got - ref).abs() / scale).max().item()


def _assert_prefix(long, short, n: int, dtype: str) -> None:
    for name in ("aux_hidden", "last_hidden"):
        worst = _worst(getattr(long, name)[:n], getattr(short, name))
        assert worst <= BOUND[dtype], f"{name}: prefix rows differ by {worst:.3g} of the row scale ({dtype})"


def test_a_long_capture_has_one_row_per_token_and_its_prefix_is_the_short_capture(engine, long_ids):
    h = engine.info.hidden_size
    (long,) = engine.capture([long_ids])
    assert long.aux_hidden.shape == (LONG, 3 * h) and long.last_hidden.shape == (LONG, h)
    assert str(long.aux_hidden.dtype).removeprefix("torch.") == engine.info.dtype
    assert torch.isfinite(long.aux_hidden.float()).all() and torch.isfinite(long.last_hidden.float()).all()
    (short,) = engine.capture([long_ids[:SHORT]])
    assert short.aux_hidden.shape == (SHORT, 3 * h)
    _assert_prefix(long, short, SHORT, engine.info.dtype)
    # positions past the prefix are computed, not copies of it (a capture that restarted positions
    # or dropped rows would show the prefix again here)
    assert _worst(long.aux_hidden[SHORT:2 * SHORT], short.aux_hidden) > 0.1


@pytest.mark.parametrize("engine", ["float32"], indirect=True)  # a padded forward costs ~10 s here
def test_a_long_sample_padded_beside_a_short_one_in_one_forward(engine, long_ids):
    """Extraction batches samples: the 2K sample is right-padded to the long one (plan_groups puts both in
    one forward of 2 x 8,192 within batch_tokens), and neither sample's rows change."""
    other = long_ids[-SHORT:]
    long, short = engine.capture([long_ids, other])
    assert long.aux_hidden.shape[0] == LONG and short.aux_hidden.shape[0] == SHORT
    (lone_long,) = engine.capture([long_ids])
    (lone_short,) = engine.capture([other])
    _assert_prefix(long, lone_long, LONG, engine.info.dtype)
    _assert_prefix(short, lone_short, SHORT, engine.info.dtype)


# ------------------------------------------------------------------ prepare: kept, rejected, truncated

@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def long_conversation() -> Sample:
    """A 24-turn conversation of about 5K SmolLM2 tokens: shipped demo prompts, made-up answers."""
    from eagle3_ray.data.sources import resolve_data_path

    prompts = [json.loads(x)["prompt"] for x in resolve_data_path("builtin:demo_prompts").read_text().splitlines()
               if x.strip()][:24]
    messages = []
    for i, p in enumerate(prompts):
        answer = " ".join(f"Point {j} of answer {i}: the reply goes on with step {i * j} and its reason." for j in range(9))
        messages += [{"role": "user", "content": p}, {"role": "assistant", "content": answer}]
    return Sample(sample_id="long-0", messages=messages, source="test:1")


@pytest.fixture(scope="module")
def whole(tokenizer, long_conversation):
    """The conversation tokenized with no length limit."""
    return tokenize_conversation(tokenizer, long_conversation, max_length=10**9)


def test_a_sample_up_to_max_length_is_kept_whole(tokenizer, long_conversation, whole):
    n = len(whole.input_ids)
    assert 2 * SHORT < n < LONG  # longer than the presets allow, within the long preset
    assert whole.input_ids == tokenizer(render(tokenizer, long_conversation.messages), add_special_tokens=False)["input_ids"]
    assert whole.loss_mask[-2] == 1  # the last answer's end-of-turn token is trained on (then the template's "\n")
    cfg = load_config("configs/smollm2-long.yaml")
    assert cfg.data.max_length == LONG
    kept = tokenize_conversation(tokenizer, long_conversation, cfg.data.max_length, cfg.data.truncate)
    assert kept.input_ids == whole.input_ids and kept.loss_mask == whole.loss_mask
    at_limit = tokenize_conversation(tokenizer, long_conversation, max_length=n)  # the boundary: == is kept
    assert at_limit.input_ids == whole.input_ids


def test_a_sample_over_max_length_is_rejected_or_truncated_as_configured(tokenizer, long_conversation, whole):
    n = len(whole.input_ids)
    for limit in (SHORT, n - 1):
        with pytest.raises(SampleRejected, match=rf"^{n} tokens > data.max_length={limit}; raise data.max_length "
                                                 r"or set data.truncate=true"):
            tokenize_conversation(tokenizer, long_conversation, max_length=limit)
    cut = tokenize_conversation(tokenizer, long_conversation, max_length=SHORT, truncate=True)
    assert cut.input_ids == whole.input_ids[:SHORT] and cut.loss_mask == whole.loss_mask[:SHORT]


def test_the_prepare_udf_keeps_the_long_sample_and_names_the_reason_when_it_rejects(smollm2_dir, long_conversation,
                                                                                    whole):
    from eagle3_ray.extract.udfs import TokenizeUDF

    batch = {"sample_id": np.asarray(["long-0"]), "messages": np.asarray([json.dumps(long_conversation.messages)]),
             "source": np.asarray(["test:1"])}
    kept = TokenizeUDF(str(smollm2_dir), max_length=LONG, truncate=False)(batch).to_pylist()[0]
    assert kept["reject"] == "" and kept["num_tokens"] == len(whole.input_ids) and kept["input_ids"] == whole.input_ids
    cut = TokenizeUDF(str(smollm2_dir), max_length=SHORT, truncate=True)(batch).to_pylist()[0]
    assert cut["reject"] == "" and cut["num_tokens"] == SHORT
    refused = TokenizeUDF(str(smollm2_dir), max_length=SHORT, truncate=False)(batch).to_pylist()[0]
    assert refused["num_tokens"] == 0 and refused["reject"].startswith(f"{len(whole.input_ids)} tokens > data.max_length")


# ------------------------------------------------------------------ online / hybrid: the capture actor

def _write_prepared(path, samples: list[tuple[str, list[int], list[int]]]) -> None:
    """prepared.parquet as the prepare stage writes it (eagle3_ray/extract/prepared.py)."""
    path.mkdir(parents=True)
    pq.write_table(pa.table({
        "sample_id": pa.array([s for s, _, _ in samples], pa.string()),
        "input_ids": pa.array([i for _, i, _ in samples], pa.list_(pa.int32())),
        "loss_mask": pa.array([m for _, _, m in samples], pa.list_(pa.uint8())),
        "num_tokens": pa.array([len(i) for _, i, _ in samples], pa.int64()),
        "source": pa.array(["test:1"] * len(samples), pa.string()),
    }), path / "prepared.parquet")


def test_online_and_hybrid_capture_stream_a_long_sample_whole(long_target, whole, tmp_path):
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.extract.udfs import PackCaptureUDF
    from eagle3_ray.features import open_store
    from eagle3_ray.features.record import uint16_to_bf16
    from eagle3_ray.features.store import StoreMeta
    from eagle3_ray.train.data import row_to_batch

    long_ids, long_mask = whole.input_ids, whole.loss_mask
    n = len(long_ids)
    short = [(f"short-{k}", long_ids[k * 300:(k + 1) * 300], long_mask[k * 300:(k + 1) * 300]) for k in range(2)]
    _write_prepared(tmp_path / "prepare", [("long-0", long_ids, long_mask), *short])  # sorted by id: long first
    cfg = load_config("configs/ci-tiny.yaml", [f"target.model={long_target}"])
    meta = StoreMeta.from_engine_info(describe_target(cfg.target))
    udf = PackCaptureUDF(str(tmp_path / "prepare"), cfg.target, cfg.extract.batch_tokens, meta,
                         store_root=str(tmp_path / "store"))  # hybrid: also commits to the store
    samples = np.empty(2, dtype=object)
    samples[0], samples[1] = np.asarray([0]), np.asarray([1, 2])  # the long sample makes a pack of its own
    rows = udf({"key": np.asarray(["0:0", "0:1"]), "samples": samples})
    assert list(rows["key"]) == ["0:0", "0:1"]
    (want,) = udf.engine.capture([long_ids])
    got_aux = uint16_to_bf16(np.ascontiguousarray(rows["aux_hidden"][0]))
    assert got_aux.shape == (n, 3 * meta.hidden_size)
    assert torch.equal(got_aux, want.aux_hidden.to(torch.bfloat16))
    assert torch.equal(uint16_to_bf16(np.ascontiguousarray(rows["last_hidden"][0])), want.last_hidden.to(torch.bfloat16))
    assert np.array_equal(rows["input_ids"][0], np.asarray(long_ids)) and len(rows["seq_ids"][1]) == 600
    store = open_store(tmp_path / "store")
    assert dict(zip(store.sample_ids, store.lengths.tolist())) == {"long-0": n, "short-0": 300, "short-1": 300}
    rec = store[store.sample_ids.index("long-0")]
    assert torch.equal(rec["aux_hidden"], want.aux_hidden.to(torch.bfloat16))
    # the training worker's conversion (sdpa rows of about 2,048 tokens): the long sample is one row of its own
    batch = row_to_batch({k: rows[k][0] for k in rows if k != "key"}, torch.device("cpu"), torch.float32,
                         row_tokens=SHORT)
    assert batch["seq_ids"].shape == (1, n) and (batch["seq_ids"] == 0).all()
    assert torch.equal(batch["position_ids"][0], torch.arange(n))
