"""Background prefetch of training packs: the next rows of a worker's Ray Data shard are fetched and
copied to the device while the current step runs.

Without it, every step first waited for its pack on the training thread: taking the row from Ray
Data, making its arrays contiguous and copying them to the GPU (64 MB per 2048-token pack at the
8B shape), with the GPU idle all the while. The `input_wait` metric shows what is left of that wait
(benchmarks/results/README.md).

On CUDA the copies run on a side stream; the training stream waits for the pack's event before
using it, and the tensors are recorded on that stream so the allocator does not reuse their memory
early. On CPU the thread only does the conversion.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable

import numpy as np
import torch

_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class PackPrefetcher:
    """Iterate (key, batch, info) over `rows`, `depth` packs ahead, skipping keys in `skip`.

    `convert(row) -> (batch: dict[str, Tensor], info)` runs on the prefetch thread (on CUDA inside a
    side stream; `info` is anything host-side, e.g. the pack's token count); an exception there is
    raised by `next()` on the training thread. `next()` returns None at the end of the rows. Call
    `close()` (or use as a context manager) to stop the thread early.
    """

    def __init__(self, rows: Iterable[dict], convert: Callable[[dict], tuple[dict[str, torch.Tensor], Any]],
                 device: torch.device, skip: frozenset[str] = frozenset(), depth: int = 2):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.device = device
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, args=(rows, convert, skip), daemon=True,
                                        name="pack-prefetch")
        self._thread.start()

    def _run(self, rows, convert, skip) -> None:
        try:
            for row in rows:
                key = str(row["key"])
                if key in skip:  # trained on before a resume
                    continue
                event = None
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        batch, info = convert(row)
                        event = torch.cuda.Event()
                        event.record(self._stream)
                else:
                    batch, info = convert(row)
                if not self._put((key, batch, info, event)):
                    return
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._put(_Failure(e))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> tuple[str, dict[str, torch.Tensor], Any] | None:
        if self._done:
            return None
        item = self._q.get()
        if item is _END:
            self._done = True
            return None
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        key, batch, info, event = item
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for t in batch.values():
                t.record_stream(stream)
        return key, batch, info

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a pending put
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10)

    def __enter__(self) -> "PackPrefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReplayCache:
    """The rows of a source read again and again (a worker's held-out packs, at every evaluation).

    The first complete pass reads ``read()`` and keeps copies of its rows, up to ``max_bytes`` of
    arrays; later passes replay the copies without reading the source. On Ray Data every read of
    the held-out shard starts a new execution of its dataset: 14-16 s for 18 packs on the H200, nine
    times in a 1,727-step run (benchmarks/results/README.md, the 2026-12-03 night session). A source
    over the cap is read every time, as before; ``max_bytes=0`` never keeps anything.
    """

    def __init__(self, read: Callable[[], Iterable[dict]], max_bytes: int):
        self.read, self.max_bytes = read, max_bytes
        self.rows: list[dict] | None = None  # set once a whole pass fit under the cap
        self.too_big = max_bytes <= 0

    def __iter__(self):
        if self.rows is not None:
            yield from self.rows
            return
        kept: list[dict] | None = None if self.too_big else []
        size = 0
        for row in self.read():
            if kept is not None:
                size += sum(v.nbytes for v in row.values() if isinstance(v, np.ndarray))
                if size > self.max_bytes:
                    kept, self.too_big = None, True
                else:  # copies: a row's arrays may be views of Ray's object store, freed after the pass
                    kept.append({k: v.copy() if isinstance(v, np.ndarray) else v for k, v in row.items()})
            yield row
        if kept is not None:  # only a complete pass: an interrupted one is read again next time
            self.rows = kept
