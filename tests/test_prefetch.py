"""PackPrefetcher: packs in order, ahead of the training thread, errors surfaced, early stop."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from eagle3_ray.train.prefetch import PackPrefetcher, ReplayCache

CPU = torch.device("cpu")


def _rows(n, seen=None):
    for i in range(n):
        if seen is not None:
            seen.append(i)
        yield {"key": f"0:{i}", "x": i}


def _convert(row):
    return {"x": torch.full((3,), float(row["x"]))}, row["x"] * 10


def test_packs_come_in_order_and_skip_consumed_keys():
    with PackPrefetcher(_rows(6), _convert, CPU, skip=frozenset({"0:1", "0:4"})) as p:
        got = []
        while (item := p.next()) is not None:
            got.append((item[0], item[1]["x"][0].item(), item[2]))
    assert got == [("0:0", 0.0, 0), ("0:2", 2.0, 20), ("0:3", 3.0, 30), ("0:5", 5.0, 50)]


def test_it_fetches_ahead_but_no_further_than_its_depth():
    seen = []
    with PackPrefetcher(_rows(10, seen), _convert, CPU, depth=2) as p:
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:  # 2 queued + 1 waiting to be put
            time.sleep(0.01)
        time.sleep(0.2)
        assert len(seen) == 3, seen  # the training thread has taken nothing yet
        assert p.next()[0] == "0:0"


def test_an_error_while_loading_is_raised_on_the_training_thread():
    def rows():
        yield {"key": "0:0", "x": 0}
        raise OSError("shard 7 is truncated")

    with PackPrefetcher(rows(), _convert, CPU) as p:
        assert p.next()[0] == "0:0"
        with pytest.raises(OSError, match="shard 7"):
            p.next()
        assert p.next() is None


def test_close_stops_the_thread_while_it_waits_to_put():
    p = PackPrefetcher(_rows(1000), _convert, CPU, depth=1)
    p.next()
    p.close()
    assert not p._thread.is_alive()
    assert not any(t.name == "pack-prefetch" for t in threading.enumerate())


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        PackPrefetcher(_rows(1), _convert, CPU, depth=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side-stream copy path")
def test_cuda_packs_are_ready_on_the_training_stream():
    dev = torch.device("cuda")
    with PackPrefetcher(_rows(4), lambda r: ({"x": _convert(r)[0]["x"].to(dev)}, None), dev) as p:
        while (item := p.next()) is not None:
            assert item[1]["x"].device.type == "cuda"
            assert (item[1]["x"] == float(item[0].split(":")[1])).all()


def _held_out_source(n=3, tokens=4):
    """A source as a held-out shard yields it: rows of arrays, read-only views like Ray's, counted."""
    reads = []

    def read():
        reads.append(1)
        for i in range(n):
            ids = np.arange(i, i + tokens)
            ids.flags.writeable = False
            yield {"key": f"p{i}", "input_ids": ids, "aux_hidden": np.full((tokens, 6), i, np.uint16)}

    return read, reads


def _passes(cache, n):
    return [[(r["key"], r["input_ids"].tolist(), int(r["aux_hidden"].sum())) for r in cache] for _ in range(n)]


def test_the_held_out_rows_are_read_once_and_replayed():
    read, reads = _held_out_source()
    cache = ReplayCache(read, max_bytes=1 << 20)
    first, *rest = _passes(cache, 3)
    assert all(p == first for p in rest) and [k for k, *_ in first] == ["p0", "p1", "p2"]
    assert len(reads) == 1
    assert cache.rows[0]["input_ids"].flags.writeable  # copies, not the source's views


def test_a_source_over_the_cap_is_read_every_time_and_an_interrupted_pass_is_not_kept():
    read, reads = _held_out_source()
    row_bytes = 4 * 8 + 4 * 6 * 2
    over = ReplayCache(read, max_bytes=2 * row_bytes)  # two of the three rows fit
    assert _passes(over, 3)[0] == _passes(over, 1)[0] and len(reads) == 4 and over.rows is None
    read, reads = _held_out_source()
    never = ReplayCache(read, max_bytes=0)
    _passes(never, 2)
    assert len(reads) == 2
    read, reads = _held_out_source()
    cut = ReplayCache(read, max_bytes=1 << 20)
    next(iter(cut))  # an evaluation stopped after one row
    assert cut.rows is None
    _passes(cut, 2)
    assert len(reads) == 2  # read again once, complete, then replayed
