"""Spark's pickled batches fed without unpickling them (``_ember.scan_pickled``,
``ember/pickled.h``): what the scan takes converts to the same columns as the
records unpickled, what it refuses (other forms, malformed or truncated
bytes) falls back to Python's pickle, and ``_grouping.frame_chunks`` cuts a
partition's frames into the feed's chunks.

No Spark: the frames are made as PySpark's batched serializer makes them
(``pickle.dumps(list of records, protocol 5)``).  The Spark paths are in
test_standalone.py (a retried feeding task of a pickled RDD) and bench-feed.
"""
from __future__ import annotations

import collections
import gc
import itertools
import pickle
import random
from typing import Any, List

import numpy as np
import pytest
from pyspark.serializers import CPickleSerializer

from ember import _columns, _ember, _grouping
from test_records_c import assert_same_specs

rng = np.random.default_rng(11)
Point = collections.namedtuple("Point", "x y")


def frame(records: List[Any]) -> bytes:
    """A frame as PySpark's batched serializer writes it."""
    return CPickleSerializer().dumps(records)


def columns_both_ways(records: List[Any]) -> None:
    """The scan's columns are byte-identical to the Python path's, for the whole
    frame, a slice of it, and the frame split into two parts of one chunk."""
    scanned = _ember.scan_pickled(frame(records))
    assert scanned is not None and len(scanned) == len(records)
    fields = _columns._pickled_fields(scanned)
    assert fields == _columns._record_fields(records[0])
    n, half = len(records), len(records) // 2
    for chunk, want in [(scanned, records),
                        (scanned.slice(1, half + 1), records[1:half + 1]),
                        ((scanned.slice(0, half), scanned.slice(half, n)), records)]:
        if not _columns.records_in(chunk):
            continue
        got = _columns._records_to_columns_c(chunk, fields, None)
        assert got is not None
        layout: dict = {}
        expect = _columns._records_to_columns_py(list(want), "p", 0, layout)
        assert_same_specs(got[0], expect[0])
        assert got[1] == layout["refs"]
        assert all(_same(a, b) for a, b in zip(_columns.unpickled(chunk), want, strict=True))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return type(a) is type(b) and (a == b or a != a)  # nan


SCANNED = {
    "image_label": [(rng.random(784).astype(np.float32), i % 10) for i in range(40)],
    "arrays_2d_and_3d": [(rng.random((28, 28)), rng.integers(0, 255, (2, 3, 4), np.uint8), i)
                         for i in range(6)],
    **{f"arrays_{np.dtype(t).name}": [(np.arange(3, dtype=t) * i, i) for i in range(4)]
       for t in (np.float32, np.float64, np.int32, np.int64, np.uint8)},
    "bool_arrays": [(np.array([i % 2 == 0, True, False]), 1.5) for i in range(5)],
    "numbers": [(float(i) / 3, -i, i % 2 == 0, 2 ** 40 + i) for i in range(300)],
    "int_edges": [(2 ** 63 - 1,), (-(2 ** 63),), (0,), (-1,), (255,), (256,), (65535,),
                  (65536,), (-(2 ** 31),), (2 ** 31,)],
    "float_specials": [(float("nan"),), (-0.0,), (float("inf"),), (1e-310,)],
    "bare_ints": list(range(-50, 50)),
    "bare_floats": [i * 0.25 for i in range(10)],
    "bare_arrays": [rng.random(5) for _ in range(7)],
    "one_array_twice": [(a, i) for a in [np.ones(4, np.float32)] for i in range(3)],
    "one_record": [(np.zeros(2, np.float32), 0)],
    "empty_rows": [(np.zeros(0, np.float32), 1), (np.zeros(0, np.float32), 2)],
}


@pytest.mark.parametrize("name", sorted(SCANNED))
def test_scanned_records_convert_as_unpickled_ones(name):
    columns_both_ways(SCANNED[name])


REFUSED = {
    "str_field": [("cat", 1)],
    "bytes_field": [(b"ab", 1)],
    "none_field": [(None, 1)],
    "list_field": [([1.0, 2.0], 1)],
    "nested_tuple": [((1, 2), 3)],
    "mixed_int_float": [(1,), (2.5,)],
    "mixed_kinds_of_records": [(1, 2), 3],
    "mixed_widths": [(1, 2), (3,)],
    "mixed_shapes": [(np.zeros(3, np.float32),), (np.zeros(4, np.float32),)],
    "mixed_dtypes": [(np.zeros(3, np.float32),), (np.zeros(3, np.float64),)],
    "float16": [(np.zeros(3, np.float16),)],
    "int16": [(np.zeros(3, np.int16),)],
    "big_endian": [(np.zeros(3, ">f4"),)],
    "fortran": [(np.asfortranarray(np.zeros((3, 2), np.float32)),)],
    "zero_dims": [(np.array(1.5, np.float32),)],
    "numpy_scalars": [(np.float32(1.5), np.int64(2))],
    "object_array": [(np.array([1, "a"], dtype=object),)],
    "structured": [(np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]),)],
    "beyond_int64": [(2 ** 63,)],
    "namedtuple": [Point(1.0, 2.0)],
    "dict": [{"a": 1}],
    "empty_tuple": [()],
    "empty": [],
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_forms_are_refused_for_pickle_to_read(name):
    assert _ember.scan_pickled(frame(REFUSED[name])) is None


@pytest.mark.parametrize("protocol", [2, 3, 4])
def test_older_protocols_are_refused(protocol):
    """numpy pickles arrays as a reconstruct call below protocol 5; numbers alone
    read the same in every protocol from 2."""
    records = [(np.zeros(3, np.float32), 1)]
    assert _ember.scan_pickled(pickle.dumps(records, protocol)) is None
    got = _ember.scan_pickled(pickle.dumps([(1, 2.5, True)] * 3, protocol))
    assert got is not None and len(got) == 3


def test_malformed_and_truncated_frames_are_refused_or_read_as_pickle_reads_them():
    """Every prefix of a frame, and frames with random bytes changed: the scan
    refuses them, or takes them and converts what pickle.loads returns (the
    scan calls nothing, so pickle only runs where the scan took the bytes)."""
    good = frame([(np.arange(6, dtype=np.float32) + i, i, i * 0.5) for i in range(5)])
    for end in range(len(good)):
        assert _ember.scan_pickled(good[:end]) is None
    assert _ember.scan_pickled(good + b"x") is None  # bytes after STOP
    r = random.Random(5)
    taken = 0
    for _ in range(3000):
        b = bytearray(good)
        for _ in range(r.randint(1, 3)):
            b[r.randrange(len(b))] = r.randrange(256)
        scanned = _ember.scan_pickled(bytes(b))
        if scanned is None:
            continue
        taken += 1
        records = pickle.loads(bytes(b))
        fields = _columns._pickled_fields(scanned)
        got = _ember.records_to_columns(scanned, fields, None)
        want = _ember.records_to_columns(records, fields, None)
        assert got is not None and want is not None
        assert [(c[:3], bytes(c[3])) for c in got[0]] == [(c[:3], bytes(c[3])) for c in want[0]]
    assert taken > 100  # most changes hit the arrays' data, which still reads
    with pytest.raises(TypeError):
        _ember.scan_pickled(bytearray(good))  # type: ignore[arg-type]


def test_parts_of_a_chunk_must_agree():
    """A chunk of two frames whose fields differ goes to the Python path, which
    names the record."""
    a = _ember.scan_pickled(frame([(np.zeros(3, np.float32), 1)] * 2))
    b = _ember.scan_pickled(frame([(np.zeros(4, np.float32), 1)] * 2))
    c = _ember.scan_pickled(frame([(1.5, 2)] * 2))
    assert a is not None and b is not None and c is not None
    assert _ember.records_to_columns((a, b), ["0", "1"], None) is None
    assert _ember.records_to_columns((a, c), ["0", "1"], None) is None
    assert _ember.records_to_columns((a, a), ["0", "1"], None) is not None
    assert _ember.records_to_columns((a,), ["0"], None) is None  # not its fields
    with pytest.raises(TypeError, match="records is a list"):  # not all pickled
        _ember.records_to_columns((a, [1]), ["0", "1"], None)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="record 2 has shape"):
        _columns._records_to_columns_py(_columns.unpickled((a, b)), "p", 0, {})


def test_a_later_chunk_must_agree_with_the_partitions_first():
    """The layout the first chunk sets (kind and shape) holds for a pickled one."""
    layout: dict = {}
    _columns.records_to_columns([(np.zeros(3, np.float32), 1)], "p", 0, layout)
    same = _ember.scan_pickled(frame([(np.ones(3, np.float32), 2)]))
    other = _ember.scan_pickled(frame([(np.ones(4, np.float32), 2)]))
    floats = _ember.scan_pickled(frame([(np.ones(3, np.float32), 2.5)]))
    assert _ember.records_to_columns(same, layout["fields"], layout["refs"]) is not None
    assert _ember.records_to_columns(other, layout["fields"], layout["refs"]) is None
    assert _ember.records_to_columns(floats, layout["fields"], layout["refs"]) is None


def frames_of(sizes: List[int], scan: bool = True) -> List[Any]:
    out, at = [], 0
    for n in sizes:
        records = [(np.full(2, at + i, np.float32), at + i) for i in range(n)]
        out.append(_ember.scan_pickled(frame(records)) if scan else records)
        at += n
    return out


def ids_of(chunk: Any) -> List[int]:
    return [r[1] for r in _columns.unpickled(chunk)]


@pytest.mark.parametrize("skip", [0, 1, 3, 7, 8, 40, 95, 96, 200])
def test_frame_chunks_join_and_cut_frames(skip):
    """Frames of 1, 2, 4 ... records join into chunks of cut["rows"]; a frame
    longer than a chunk is cut; a retry's skip starts inside a frame."""
    sizes = [1, 2, 4, 8, 16, 32, 32, 1]
    cut = {"rows": 20}
    chunks = list(_grouping.frame_chunks(iter(frames_of(sizes)), skip, cut))
    assert all(isinstance(c, tuple) for c in chunks)
    assert [r for c in chunks for r in ids_of(c)] == list(range(skip, sum(sizes)))
    assert all(_columns.records_in(c) == 20 for c in chunks[:-1])


def test_frame_chunks_read_the_cut_at_each_chunk():
    cut = {"rows": 50}
    seen = []
    for c in _grouping.frame_chunks(iter(frames_of([64, 64, 64])), 0, cut):
        seen.append(_columns.records_in(c))
        cut["rows"] = 30  # what the feed does after a batch too large for its ring
    assert seen == [50, 30, 30, 30, 30, 22]


def test_frame_chunks_keep_the_order_of_scanned_and_unscanned_frames():
    """Frames that did not scan come as their records (lists) and keep their place."""
    scanned = frames_of([5, 5, 5, 5])
    plain = frames_of([5, 5, 5, 5], scan=False)
    mixed = [scanned[0], plain[1], plain[2], scanned[3]]
    chunks = list(_grouping.frame_chunks(iter(mixed), 2, {"rows": 4}))
    assert [type(c).__name__ for c in chunks] == ["tuple"] + ["list"] * 3 + ["tuple", "tuple"]
    assert [r for c in chunks for r in ids_of(c)] == list(range(2, 20))


def test_scans_leak_nothing():
    """Scans, slices, joined parts and refusals keep Python's memory flat."""
    import tracemalloc

    good = frame([(np.ones(16, np.float32), i, 0.5) for i in range(64)])
    bad = frame([("x", 1)])

    def one_round() -> None:
        s = _ember.scan_pickled(good)
        assert s is not None
        parts = (s.slice(0, 10), s.slice(10, 64))
        assert _ember.records_to_columns(parts, ["0", "1", "2"], None) is not None
        assert _ember.scan_pickled(bad) is None
        assert _ember.scan_pickled(good[:100]) is None

    for _ in range(200):
        one_round()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(5000):
            one_round()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, grown


def test_pickled_records_are_not_made_from_python():
    with pytest.raises(TypeError):
        _ember.PickledRecords()  # type: ignore[call-arg]
    s = _ember.scan_pickled(frame([1, 2, 3]))
    assert s is not None and s.fields is None and (s.start, s.stop) == (0, 3)
    t = s.slice(-5, 99)
    assert (t.start, t.stop, len(t)) == (0, 3, 3)
    assert len(s.slice(2, 1)) == 0
    assert list(itertools.islice(_columns.unpickled(s.slice(1, 3)), 5)) == [2, 3]
