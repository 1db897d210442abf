"""Ember's inference worker: the Python end of EmberModel's direct path.

The executor JVM (``ember.spark.DirectInference``) starts it through
``python -m ember._direct_launcher <model path> <runtime>`` (the path of the
model it starts for shows in ``ps``; nothing reads it), which has it forked
from a fork server with its runtime imported, or runs it in its own
process; the JVM keeps it for later
tasks, of that model or of another of the same runtime.  Over stdin it sends
the pickled inference spec once, then batches: a big-endian int32 row count
followed, per input column, by the rows' values packed little-endian
(``count * row bytes``); a count of 0 ends a task, -1 asks for an empty
answer (the JVM's check, before it gives an idle worker a task, that the
worker still lives), and -2, followed by an int32 length and a pickled spec,
hands the worker another model, which replaces the one it holds.  For each batch this
process answers on stdout with int32 status, int32 length and either one
Arrow IPC stream holding the output columns (status 0) or a UTF-8 message
naming what was wrong (status 1, after which it exits).  A reader thread
reads the next batch while the model runs.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import sys
import threading
from typing import Any, BinaryIO, Dict, List, NamedTuple, Optional, Protocol, Tuple

import numpy as np

MAGIC = 0x454D4231
PING = -1
LOAD = -2

Columns = List[Tuple[str, np.dtype, Tuple[int, ...]]]


class _Model(NamedTuple):
    """An inference spec and the input columns it names."""

    spec: Dict[str, Any]
    columns: Columns


class _Input(Protocol):
    """What the worker reads its input from: a raw or buffered binary file."""

    def readinto(self, buffer: memoryview, /) -> Optional[int]: ...


def _read_into(f: _Input, buf: Any) -> bool:
    """Fills ``buf`` from ``f``; False at a clean end of input before any byte."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            if got == 0:
                return False
            raise EOFError(f"input ended {got} bytes into a {len(view)}-byte read")
        got += k
    return True


def _int(f: _Input) -> Optional[int]:
    b = bytearray(4)
    return struct.unpack(">i", b)[0] if _read_into(f, b) else None


def _model(f: _Input) -> _Model:
    """The next inference spec on ``f`` (length-prefixed pickle)."""
    size = _int(f)
    blob = bytearray(size or 0)
    if size is None or not _read_into(f, blob):
        raise EOFError("input ended before the inference spec")
    spec = pickle.loads(bytes(blob))
    return _Model(spec, [(name, np.dtype(dtype), tuple(shape))
                         for name, dtype, shape in spec["direct_columns"]])


def _batches(f: _Input, columns: Columns, out: "queue.Queue"):
    """Reader thread: (rows, [row arrays per column]) per batch, None per task end,
    a :class:`_Model` per model handed over (whose columns the next batches
    have); an exception object on failure; stops at the end of input."""
    try:
        while True:
            n = _int(f)
            if n is None:
                out.put(EOFError())
                return
            if n == 0:
                out.put(None)
                continue
            if n == PING:
                out.put(PING)
                continue
            if n == LOAD:
                model = _model(f)
                columns = model.columns
                out.put(model)
                continue
            arrays = []
            for _name, dtype, shape in columns:
                x = np.empty((n, *shape), dtype=dtype)
                if not _read_into(f, x):
                    raise EOFError("input ended inside a batch")
                arrays.append(x)
            out.put((n, arrays))
    except BaseException as exc:  # handed to the main thread, which reports it
        out.put(exc)


def _reply(out: BinaryIO, status: int, body: bytes) -> None:
    out.write(struct.pack(">ii", status, len(body)))
    out.write(body)
    out.flush()


def serve(inp: _Input, out: BinaryIO) -> int:
    import pyarrow as pa

    from ember.ml import _runtime

    if _int(inp) != MAGIC:
        raise ValueError("not an Ember direct-inference stream (bad magic)")
    model = _model(inp)

    def load(spec: Dict[str, Any]) -> Tuple[Any, List[str], Any]:
        p = _runtime.predictor(spec)
        out_cols = spec["output_columns"]
        return p, out_cols, pa.schema([pa.field(c, _runtime.arrow_type(info))
                                       for c, info in zip(out_cols, p.outputs)])

    p, out_cols, schema = load(model.spec)
    ready: "queue.Queue" = queue.Queue(maxsize=2)
    threading.Thread(target=_batches, args=(inp, model.columns, ready), daemon=True).start()
    rows_seen = 0
    while True:
        item = ready.get()
        if item is None:  # a task ended; its rows are numbered afresh
            rows_seen = 0
            continue
        if item is PING:
            _reply(out, 0, b"")
            continue
        if isinstance(item, _Model):  # another model: it replaces this one (one model's memory)
            _runtime.forget(model.spec)
            model = item
            p, out_cols, schema = load(model.spec)
            continue
        if isinstance(item, EOFError) and not str(item):
            return 0  # the JVM closed the pipe: the executor is done with this worker
        if isinstance(item, BaseException):
            raise item
        n, arrays = item
        where = f"rows {rows_seen}..{rows_seen + n - 1} of the task's partition"
        xs = [_runtime.fit_input(x, name, info, where)
              for (name, _d, _s), x, info in zip(model.columns, arrays, p.inputs)]
        batch = pa.RecordBatch.from_arrays(
            _runtime.outputs_to_arrow(p, p.run(xs), out_cols, n), schema=schema)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as writer:
            writer.write_batch(batch)
        _reply(out, 0, sink.getvalue().to_pybytes())
        rows_seen += n


def main() -> int:
    inp = os.fdopen(0, "rb", buffering=0)
    out = os.fdopen(os.dup(1), "wb", buffering=1 << 16)
    os.dup2(2, 1)  # stray prints (TensorFlow's, a model's) go to the log, not the protocol
    sys.stdout = sys.stderr
    try:
        return serve(inp, out)
    except BrokenPipeError:
        return 0
    except Exception as exc:  # the JVM fails the task with this message; the log keeps the trace
        try:
            _reply(out, 1, f"{type(exc).__name__}: {exc}".encode())
        except OSError:
            pass
        raise


if __name__ == "__main__":
    sys.exit(main())
