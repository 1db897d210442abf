"""The C fast path of records_to_columns (``_ember.records_to_columns``) against
the Python one (``_columns._records_to_columns_py``): byte-identical columns
for every record shape the feed takes, the same errors (the C path hands every
chunk it does not convert exactly to the Python one), and no leaks.

No Spark: pyspark's Row is only a tuple subclass here.
"""
from __future__ import annotations

import collections
import copy
import fractions
import gc
import os
import sys
import tracemalloc
from typing import Any, Dict, List, Optional

import numpy as np
import pytest

from ember import _columns, _ember
from ember.errors import EmberFeedError

Row: Any
try:
    from pyspark.sql import Row
except ImportError:  # pragma: no cover - the project's venv has pyspark
    Row = None

Point = collections.namedtuple("Point", "x y")
rng = np.random.default_rng(7)


def assert_same_specs(got: List[Any], want: List[Any]) -> None:
    """Column specs equal to the byte: names, dtypes, widths, data and offsets."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[:3] == w[:3], (g[:3], w[:3])
        gd, wd = g[3], w[3]
        if w[1] == _ember.DT_BYTES:
            assert type(gd) is bytes and bytes(gd) == bytes(wd)
            assert g[4].dtype == w[4].dtype == np.uint64
            assert g[4].tolist() == w[4].tolist()
        else:
            assert isinstance(gd, np.ndarray)
            assert (gd.dtype, gd.shape) == (wd.dtype, wd.shape)
            assert gd.tobytes() == wd.tobytes()
            assert gd.flags.c_contiguous and gd.flags.writeable
            assert g[4] is None and w[4] is None


def fast(records: List[Any], layout: Optional[Dict[str, Any]] = None) -> Any:
    """The C path's own answer for a chunk (None: it hands the chunk to Python)."""
    layout = {} if layout is None else dict(layout)
    fields = layout["fields"] if "fields" in layout else _columns._record_fields(records[0])
    return _columns._records_to_columns_c(records, fields, layout.get("refs"))


def convert_both(chunks: List[List[Any]], expect_fast: Optional[bool] = True) -> None:
    """Converts chunks of one partition both ways: the same specs, counts and
    layout after every chunk; expect_fast: whether the C path takes each."""
    lay_c: Dict[str, Any] = {}
    lay_py: Dict[str, Any] = {}
    at = 0
    for records in chunks:
        if expect_fast is not None and records:
            assert (fast(records, lay_c) is not None) == expect_fast
        got = _columns.records_to_columns(list(records), "feeding partition 0", at, lay_c)
        want = _columns._records_to_columns_py(list(records), "feeding partition 0", at, lay_py)
        assert got[1] == want[1] == len(records)
        assert_same_specs(got[0], want[0])
        assert lay_c == lay_py
        at += len(records)


def test_common_records_take_the_c_path(monkeypatch):
    """(image, label) records and number tuples never reach the Python path."""
    def python_path(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the Python path converted a chunk the C path takes")

    monkeypatch.setattr(_columns, "_records_to_columns_py", python_path)
    specs, n = _columns.records_to_columns([(np.zeros(784, np.float32), 3)] * 5)
    assert n == 5 and [s[0] for s in specs] == ["0", "1"]
    specs, n = _columns.records_to_columns([(1.5, 2.0, 7)] * 4)
    assert n == 4 and len(specs) == 3


# ---------------------------------------------------------------- same columns

def images(n: int, shape: tuple = (784,), dtype: Any = np.float32) -> List[np.ndarray]:
    return [rng.random(shape).astype(dtype) for _ in range(n)]


FAST_CHUNKS = {
    "image_label": [(x, i % 10) for i, x in enumerate(images(50))],
    "float_float_int": [(float(i) / 3, -float(i), i) for i in range(100)],
    "ints": list(range(-50, 50)),
    "floats": [float(i) * 0.1 for i in range(100)] + [float("nan"), -0.0, float("inf")],
    "int_float_mixed": [1, 2.5, -3, 2 ** 53 + 1, 2 ** 62 + 1, -(2 ** 63), 0.1],
    "int64_edges": [2 ** 63 - 1, -(2 ** 63), 0, -1],
    "bools": [True, False, True],
    "np_bools": [np.True_, np.False_, True],
    "np_float32": [np.float32(i) / 7 for i in range(20)],
    "np_float64": [np.float64(i) / 7 for i in range(20)],
    "np_int32": [np.int32(i - 10) for i in range(20)],
    "np_int64": [np.int64(2 ** 40 + i) for i in range(20)],
    "np_uint8": [np.uint8(i * 13 % 256) for i in range(20)],
    "np_int64_and_int": [np.int64(5), 7, np.int64(-9)],
    "np_float64_and_int": [np.float64(0.5), 7, np.int64(2 ** 60 + 3)],
    "vectors_float": [[float(i), i * 0.5, -1.0] for i in range(30)],
    "vectors_int": [[i, i + 1, i + 2] for i in range(30)],
    "vectors_int_bool": [[1, 2, 3], [True, 1, 2], [0, False, 5]],  # numpy: int64
    "vector_rows_int_float": [([1, 2], 0), ([3.5, 4], 1)],
    "vector_rows_bool": [([True, False], 0), ([False, False], 1)],
    "vector_rows_empty": [([], 0), ([], 1)],
    "arrays_2d": [(x, i) for i, x in enumerate(images(10, (28, 28)))],
    "arrays_3d": [(x,) for x in images(4, (2, 3, 4), np.float64)],
    "arrays_empty_row": [(np.zeros((0,), np.float32), 1), (np.zeros((0,), np.float32), 2)],
    "arrays_as_values": images(8, (5,), np.float64),
    "arrays_int32": [(np.arange(4, dtype=np.int32) * i,) for i in range(5)],
    "arrays_int64": [(np.arange(4, dtype=np.int64) * i,) for i in range(5)],
    "arrays_longlong": [(np.arange(4, dtype=np.longlong) * i,) for i in range(5)],
    "arrays_uint8": [(np.arange(4, dtype=np.uint8) * i,) for i in range(5)],
    "arrays_bool": [(np.array([i % 2 == 0, True]),) for i in range(5)],
    "arrays_rows_of_a_matrix": [(row, 1) for row in rng.random((6, 3))],
    "str": [("cat", 1), ("", 2), ("ünïcødé ☃", 3), ("x" * 1000, 4)],
    "bytes_kinds": [(b"ab", 1), (bytearray(b"cd"), 2), (memoryview(b"efg"), 3), (b"", 4)],
    "str_values": ["a", "bb", "ccc"],
    "bytes_values": [b"\x00\x01", b""],
    "list_records_with_text": [["a", 1], ["b", 2]],
    "list_records_with_bool": [[1.0, True], [2.0, False]],
    "namedtuples": [Point(1.0, "a"), Point(2.0, "b")],
    "empty_tuples": [(), ()],
    "label_float32_scalar": [(np.float32(0.5), np.int64(1)), (np.float32(1.5), np.int64(0))],
}


@pytest.mark.parametrize("name", sorted(FAST_CHUNKS))
def test_c_columns_are_byte_identical_to_the_python_path(name):
    convert_both([FAST_CHUNKS[name]])


def test_rows_are_tuples_of_named_fields():
    if Row is None:
        pytest.skip("pyspark not installed")
    records = [Row(image=x, label=i, name=f"r{i}") for i, x in enumerate(images(5, (2, 2)))]
    convert_both([records])
    specs, n = _columns.records_to_columns(records)
    assert [s[0] for s in specs] == ["image|2x2", "label", "name:str"] and n == 5


def test_a_chunk_of_images_is_one_contiguous_array():
    xs = images(20, (28, 28))
    specs, n = _columns.records_to_columns([(x, i) for i, x in enumerate(xs)])
    (name, dt, width, data, offs), (lname, ldt, lwidth, labels, _) = specs
    assert (name, dt, width, data.shape) == ("0|28x28", _ember.DT_F32, 784, (20, 28, 28))
    assert offs is None and n == 20
    assert np.array_equal(data, np.stack(xs))
    assert (lname, ldt, lwidth, labels.tolist()) == ("1", _ember.DT_I64, 1, list(range(20)))


def test_the_empty_chunk():
    assert _columns.records_to_columns([]) == ([], 0)
    assert _columns.records_to_columns(iter([])) == ([], 0)
    assert _ember.records_to_columns([], None, None) is None


def test_an_array_of_records_and_an_iterator_of_records():
    a = rng.random((4, 3))
    assert_same_specs(_columns.records_to_columns(a)[0],
                      _columns._records_to_columns_py(a)[0])
    recs = [(float(i), i) for i in range(5)]
    assert_same_specs(_columns.records_to_columns(iter(recs))[0],
                      _columns._records_to_columns_py(recs)[0])


SLOW_CHUNKS = {  # converted by the Python path (the C one hands them over): same result
    "float16_arrays": [(np.ones(3, np.float16),)] * 2,
    "int8_arrays": [(np.ones(3, np.int8),)] * 2,
    "big_endian_arrays": [(np.ones(3, ">f4"),)] * 2,
    "strided_arrays": [(np.arange(10.0)[::2],)] * 2,
    "mixed_dtype_arrays": [(np.ones(3, np.float32),), (np.ones(3, np.float64),)],
    "arrays_and_lists": [(np.ones(3),), ([1.0, 2.0, 3.0],)],
    "nested_lists": [([[1.0, 2.0], [3.0, 4.0]],), ([[5.0, 6.0], [7.0, 8.0]],)],
    "np_scalars_in_lists": [([np.float32(1.0), np.float32(2.0)],)] * 2,
    "np_int16_scalars": [np.int16(1), np.int16(2)],
    "np_float32_and_float": [np.float32(1.0), 2.0],
    "uint64_range_int": [2 ** 63, 1],
    "fractions": [(fractions.Fraction(1, 2), 1)],
    "str_subclass": [(type("S", (str,), {})("a"), 1)],
    "list_subclass_records": [type("L", (list,), {})([1.0, "a"])],
    "zero_d_arrays": [(np.array(1.0),)] * 2,
}


@pytest.mark.parametrize("name", sorted(SLOW_CHUNKS))
def test_chunks_off_the_fast_path_convert_as_before(name):
    records = SLOW_CHUNKS[name]
    try:
        want = _columns._records_to_columns_py(list(records), "p", 0, {})
    except EmberFeedError as e:
        with pytest.raises(EmberFeedError) as err:
            _columns.records_to_columns(list(records), "p", 0, {})
        assert str(err.value) == str(e)
        return
    assert fast(records) is None
    got = _columns.records_to_columns(list(records), "p", 0, {})
    assert got[1] == want[1]
    assert_same_specs(got[0], want[0])


def test_chunks_of_a_partition_follow_the_first_chunk():
    """A later chunk is checked against the first one's kinds and shapes and
    converted as the Python path does (int then float: float64 from then on)."""
    convert_both([[(i, float(i)) for i in range(10)], [(float(i), i) for i in range(10)]])
    convert_both([[(x, 1) for x in images(3, (2, 2))], [([[1.0, 2.0], [3.0, 4.0]], 1)]],
                 expect_fast=None)
    convert_both([[("a", b"x")], [("b", bytearray(b"y"))]])
    convert_both([[([1, 2],)], [([1.5, 2],)], [(np.ones(2, np.float32),)]])


# ---------------------------------------------------------------- same errors

def same_error(chunks: List[List[Any]], where: str = "feeding partition 3",
               first: int = 0) -> str:
    """The error of the last chunk, both ways, with identical wording."""
    messages = []
    for convert in (_columns.records_to_columns, _columns._records_to_columns_py):
        layout: Dict[str, Any] = {}
        at = first
        for records in chunks[:-1]:
            convert(copy.copy(records), where, at, layout)
            at += len(records)
        with pytest.raises((EmberFeedError, ValueError)) as err:
            convert(copy.copy(chunks[-1]), where, at, layout)
        messages.append((type(err.value), str(err.value)))
    assert messages[0] == messages[1]
    return messages[0][1]


def labelled(labels: List[Any]) -> List[Any]:
    return [Row(image=np.zeros(2, np.float32), label=v) for v in labels]


def test_a_str_among_int_labels_is_named_exactly():
    if Row is None:
        pytest.skip("pyspark not installed")
    labels: List[Any] = list(range(30))
    labels[17] = "cat"
    assert same_error([labelled(labels)]) == (
        "feeding partition 3: column 1 ('label'): record 17 is str ('cat'), earlier records "
        "are int")
    assert same_error([labelled(labels)], first=1000).startswith(
        "feeding partition 3: column 1 ('label'): record 1017 is str")


ERRORS = {
    "str_among_ints": ([[(i, "s" if i == 5 else i) for i in range(10)]],
                       "column 1: record 5 is str ('s'), earlier records are int"),
    "int_among_strs": ([[(i, 5 if i == 2 else "a") for i in range(10)]],
                       "column 1: record 2 is int (5), earlier records are str"),
    "none_first": ([[(None, 1), (2, 1)]], "column 0: record 0 is None; fill or drop nulls"),
    "none_later": ([[(1.0, 1), (None, 1)]], "column 0: record 1 is None, earlier records are "
                                            "float"),
    "bool_among_ints": ([[(i, True if i == 2 else 1) for i in range(5)]],
                        "column 1: record 2 is bool (True), earlier records are int"),
    "int_among_bools": ([[(i, 1 if i == 2 else True) for i in range(5)]],
                        "column 1: record 2 is int (1), earlier records are bool"),
    "bytes_among_strs": ([[("a",), (b"b",)]], "column 0: record 1 is bytes (b'b'), earlier"),
    "array_shapes": ([[(np.zeros(3),), (np.zeros(4),)]],
                     "column 0: record 1 has shape (4,), earlier records have shape (3,)"),
    "array_2d_shapes": ([[(np.zeros((2, 3)),), (np.zeros((3, 2)),)]],
                        "column 0: record 1 has shape (3, 2), earlier records have shape (2, 3)"),
    "ragged_lists": ([[([1.0, 2.0],), ([1.0],)]],
                     "column 0: record 1 has shape (1,), earlier records have shape (2,)"),
    "none_in_list": ([[(i, [1.0, None if i == 3 else 2.0]) for i in range(5)]],
                     "column 1: record 3, element 1 is None"),
    "str_in_list": ([[(i, [1.0, "x" if i == 3 else 2.0]) for i in range(5)]],
                    "column 1: record 3, element 1 is str ('x')"),
    "array_among_numbers": ([[(1.0,), (np.zeros(2),)]],
                            "column 0: record 1 is an array of shape (2,), earlier records are "
                            "float"),
    "not_a_tuple": ([[(1, 2), 5]], "record 1 is int (5), earlier records have 2 fields"),
    "wrong_width": ([[(1, 2), (1, 2, 3)]], "record 1 has 3 fields, earlier records have 2"),
    "unfeedable": ([[({"a": 1},)]], "column 0: record 0 is dict ({'a': 1}); the feed carries"),
    "int_beyond_int64": ([[(2 ** 70,), (1,)]], "column 0: records 0..1 do not fit one numeric"),
    "later_chunk_kind": ([[(i, i) for i in range(4)], [(i, "s") for i in range(4)]],
                         "column 1: record 4 is str ('s'), earlier records are int"),
    "later_chunk_shape": ([[(np.zeros(3, np.float32),)], [(np.zeros(2, np.float32),)]],
                          "column 0: record 1 has shape (2,), earlier records have shape (3,)"),
    "later_chunk_list_shape": ([[(i, [1.0] * 4) for i in range(10)],
                                [(i, [1.0] * 3) for i in range(10)]],
                               "column 1: record 10 has shape (3,), earlier records have shape "
                               "(4,)"),
    "later_chunk_bools": ([[(True,)], [(1,)]],
                          "column 0: record 1 is int (1), earlier records are bool"),
    "values_disagree": ([[1, "a"]], "record 1 is str ('a'), earlier records are int"),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_name_record_field_and_both_types_exactly_as_before(name):
    chunks, message = ERRORS[name]
    got = same_error(chunks)
    assert got.startswith(f"feeding partition 3: {message}"), got


def test_a_name_too_long_raises_as_before():
    long = "f" * 300
    layout = {"fields": [long]}
    with pytest.raises(ValueError, match="field name too long"):
        _columns.records_to_columns([(1,)], "p", 0, dict(layout))
    assert _ember.records_to_columns([(1,)], [long], None) is None


def test_the_fast_path_rejects_wrong_arguments():
    with pytest.raises(TypeError):
        _ember.records_to_columns((1, 2), None, None)
    with pytest.raises(TypeError):
        _ember.records_to_columns([1], "ab", None)
    assert _ember.records_to_columns([1], None, [None, None]) is None  # refs of another width
    assert _ember.records_to_columns([1], None, [("int", (3,))]) is None  # a malformed ref


# ---------------------------------------------------------------- no leaks

def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_ten_thousand_conversions_leak_nothing():
    """Refcounts of the records' values do not move, and Python's and the
    process's memory stay flat over 10,000 conversions (fast, slow and error
    chunks; sys.gettotalrefcount exists only in debug builds)."""
    x = np.ones((4, 4), np.float32)
    text, blob, big = "ünï", b"blob", 2 ** 40
    good = [(x, i, text, blob, 1.5, [1, 2.5]) for i in range(16)]
    slow = [(np.ones(3, np.float16), 1)] * 4
    bad = [(x, "s" if i == 3 else big) for i in range(8)]
    watched = (x, text, blob, big)

    def one_round() -> None:
        _columns.records_to_columns(good, "p", 0, {})
        _columns.records_to_columns(slow, "p", 0, {})
        layout: Dict[str, Any] = {}
        _columns.records_to_columns(good, "p", 0, layout)
        _columns.records_to_columns(good, "p", 16, layout)  # with refs
        assert _ember.records_to_columns(bad, ["0", "1"], None) is None
        try:
            _columns.records_to_columns(bad, "p", 0, {})
        except EmberFeedError:
            pass

    for _ in range(200):
        one_round()
    gc.collect()
    refs = [sys.getrefcount(v) for v in watched]
    tracemalloc.start()
    try:
        for _ in range(100):
            one_round()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        rss = _rss_kib()
        for _ in range(10_000):
            one_round()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(v) for v in watched] == refs
    assert grown < 256 * 1024, f"Python memory grew by {grown} bytes"
    assert _rss_kib() - rss < 16 * 1024, "RSS grew by more than 16 MiB"
