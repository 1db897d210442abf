"""ember.tfrecord without Spark or TensorFlow: writer/reader round trips,
sharding, schema errors, corruption (flipped length bit, flipped data bit,
truncated tail) detected with file and offset or skipped and counted, and
the ``ember tfrecord inspect`` CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import ember.tfrecord as tfr
from ember import _ember

N = 50


def _write(path: str, n: int = N, compression=None) -> dict:
    cols = {"image": np.random.default_rng(1).random((n, 6), dtype=np.float32),
            "label": np.arange(n, dtype=np.int64) - 7,
            "name": [f"rec{i}" for i in range(n)]}
    assert tfr.write(path, cols, compression) == n
    return cols


@pytest.mark.parametrize("compression", [None, "gzip", "zlib"])
def test_round_trip_batches(tmp_path, compression):
    p = str(tmp_path / "a.tfrecord")
    cols = _write(p, compression=compression)
    assert tfr.detect_compression(p) == {None: 0, "gzip": 1, "zlib": 2}[compression]
    batches = list(tfr.reader(p, 16, {"image": ("float32", (2, 3)), "label": "int64",
                                      "name": "str"}))
    assert [len(b["label"]) for b in batches] == [16, 16, 16, 2]
    img = np.concatenate([b["image"] for b in batches])
    assert img.shape == (N, 2, 3) and np.array_equal(img.reshape(N, 6), cols["image"])
    assert np.concatenate([b["label"] for b in batches]).tolist() == cols["label"].tolist()
    assert list(np.concatenate([b["name"] for b in batches])) == cols["name"]
    # drop_remainder, epochs, names-only columns (specs from the first record)
    b2 = list(tfr.reader(p, 16, ["image", "label"], num_epochs=2, drop_remainder=True))
    assert len(b2) == 6 and b2[0]["image"].shape == (16, 6)


def test_varlen_and_raw_records(tmp_path):
    p = str(tmp_path / "v.tfrecord")
    rows = [[1.0], [], [2.0, 3.0, 4.0]]
    splits = np.array([0, 1, 1, 4], np.uint64)
    vals = np.array([1, 2, 3, 4], np.float32)
    with _ember.TFRecordWriter(p) as w:
        w.write_examples([("v", tfr.FLOAT, 0, vals, None, splits, None)], 3)
        w.write(b"not an example at all \xff")
    recs = list(tfr.open_reader(p))
    assert len(recs) == 4 and recs[3] == b"not an example at all \xff"
    it = tfr.reader(p, 3, {"v": ("float32", None)})
    b = next(it)
    assert b["v"].row_splits.tolist() == [0, 1, 1, 4]
    assert [b["v"].values[a:z].tolist() for a, z in zip(b["v"].row_splits, b["v"].row_splits[1:])] == rows
    with pytest.raises(tfr.EmberCorruptError, match=r"v.tfrecord: record 3 \(byte offset"):
        next(it)


def test_shuffle_buffer_permutes_windows_of_whole_batches(tmp_path):
    a, b = str(tmp_path / "a.tfrecord"), str(tmp_path / "b.tfrecord")
    tfr.write(a, {"label": np.arange(30, dtype=np.int64),
                  "image": np.arange(60, dtype=np.float32).reshape(30, 2)})
    tfr.write(b, {"label": np.arange(30, 50, dtype=np.int64),
                  "image": np.arange(60, 100, dtype=np.float32).reshape(20, 2)})
    cols = {"label": "int64", "image": ("float32", (2,))}

    def labels(**kw):
        got = list(tfr.reader([a, b], 8, cols, **kw))
        for x in got:  # the columns are permuted together
            assert np.array_equal(x["image"], np.stack([2.0 * x["label"], 2.0 * x["label"] + 1], 1))
        return [x["label"].tolist() for x in got]

    plain = labels()
    shuffled = labels(shuffle_buffer=12, seed=3)  # windows of 16 (two batches)
    assert [len(x) for x in shuffled] == [8, 8, 8, 8, 8, 8, 2]
    flat = sum(shuffled, [])
    assert flat != sum(plain, []) and sorted(flat) == list(range(50))
    for w in range(3):  # each window holds the records of the same window in file order
        assert sorted(flat[16 * w:16 * w + 16]) == list(range(16 * w, 16 * w + 16))
    assert labels(shuffle_buffer=12, seed=3) == shuffled  # seeded
    assert labels(shuffle_buffer=12, seed=4) != shuffled
    assert [len(x) for x in labels(shuffle_buffer=12, seed=3, drop_remainder=True)] == [8] * 6
    # windows span files and epochs: 2 epochs of 50 records are 100 records once each twice
    two = sum(labels(shuffle_buffer=40, seed=0, num_epochs=2), [])
    assert sorted(two) == sorted(list(range(50)) * 2)
    with pytest.raises(ValueError, match="shuffle_buffer must be an int >= 0"):
        next(tfr.reader(a, 8, cols, shuffle_buffer=-1))


def test_shuffle_buffer_gathers_variable_length_rows(tmp_path):
    p = str(tmp_path / "v.tfrecord")
    rows = [[float(i)] * (i % 4) for i in range(40)]
    splits = np.concatenate(([0], np.cumsum([len(r) for r in rows]))).astype(np.uint64)
    names = [("n%d" % i) * (i % 3) for i in range(40)]  # strings of 0-6 bytes
    data = "".join(names).encode()
    offsets = np.concatenate(([0], np.cumsum([len(n) for n in names]))).astype(np.uint64)
    with _ember.TFRecordWriter(p) as w:
        w.write_examples([("v", tfr.FLOAT, 0, np.array(sum(rows, []), np.float32), None, splits, None),
                          ("i", tfr.INT64, 1, np.arange(40, dtype=np.int64), None, None, None),
                          ("s", tfr.BYTES, 1, np.frombuffer(data, np.uint8), offsets, None, None)], 40)
    seen = []
    # every batch is kept until the end: the reader reuses its window's
    # memory, so a batch must own its values
    got = list(tfr.reader(p, 5, {"v": ("float32", None), "i": "int64", "s": "str"},
                          shuffle_buffer=20, seed=1))
    for x in got:
        v = x["v"]
        assert v.row_splits[0] == 0 and v.row_splits[-1] == len(v.values) and len(v.row_splits) == 6
        for i, lo, hi, name in zip(x["i"], v.row_splits, v.row_splits[1:], x["s"]):
            assert v.values[lo:hi].tolist() == rows[i] and name == names[i]
            seen.append(int(i))
    assert sorted(seen) == list(range(40)) and seen != list(range(40))


def test_shards_are_disjoint_and_complete(tmp_path):
    files = []
    for i in range(3):
        p = str(tmp_path / f"part-{i}.tfrecord")
        tfr.write(p, {"id": np.arange(i * 100, i * 100 + 10)})
        files.append(p)

    def ids(shard):
        return sorted(int(x) for b in tfr.reader(files, 4, {"id": "int64"}, shard=shard)
                      for x in b["id"])

    # 2 workers, 3 files: file sharding; 5 workers: record sharding within files
    for count in (2, 5):
        parts = [ids((i, count)) for i in range(count)]
        allids = sorted(x for p in parts for x in p)
        assert allids == sorted(i * 100 + k for i in range(3) for k in range(10))

    class Ctx:
        worker_num, num_workers = 1, 2
    assert ids(Ctx()) == ids((1, 2))


def test_schema_errors_name_file_record_feature(tmp_path):
    p = str(tmp_path / "s.tfrecord")
    _write(p)
    with pytest.raises(tfr.EmberSchemaError,
                       match=r"s.tfrecord: record 0 \(byte offset 0\): feature 'label': "
                             r"expected float_list, found int64_list"):
        next(tfr.reader(p, 8, {"label": "float32"}))
    with pytest.raises(tfr.EmberSchemaError, match="expected 5 float_list values, found 6"):
        next(tfr.reader(p, 8, {"image": ("float32", 5)}))
    with pytest.raises(tfr.EmberSchemaError, match="feature 'nope' .* is missing"):
        next(tfr.reader(p, 8, {"nope": "int64"}))
    assert issubclass(tfr.EmberSchemaError, ValueError)


def _offsets(path: str):
    """Byte offsets of the records of a plain file."""
    data = open(path, "rb").read()
    offs, i = [], 0
    while i < len(data):
        offs.append(i)
        i += 16 + int.from_bytes(data[i:i + 8], "little")
    return offs, data


@pytest.mark.parametrize("damage", ["length_bit", "data_bit", "truncated_tail"])
def test_corruption_detected_and_skipped(tmp_path, damage):
    p = str(tmp_path / "c.tfrecord")
    _write(p)
    offs, data = _offsets(p)
    buf = bytearray(data)
    if damage == "length_bit":
        bad = offs[20]
        buf[bad + 1] ^= 0x04
        want, kept = f"corrupt record at byte offset {bad}: length CRC mismatch", N - 1
    elif damage == "data_bit":
        bad = offs[33]
        buf[bad + 12 + 10] ^= 0x80
        want, kept = f"corrupt record at byte offset {bad}: data CRC mismatch", N - 1
    else:
        bad = offs[-1]
        buf = buf[:-5]
        want, kept = f"truncated record at byte offset {bad}", N - 1
    open(p, "wb").write(bytes(buf))
    with pytest.raises(tfr.EmberCorruptError) as e:
        list(tfr.reader(p, 8, {"label": "int64"}))
    assert want in str(e.value) and p in str(e.value)
    assert e.value.name in ("EMBER_ECORRUPT", "EMBER_ETRUNCATED")
    got = [int(x) for b in tfr.reader(p, 8, {"label": "int64"}, skip_corrupt=True)
           for x in b["label"]]
    assert len(got) == kept
    r = tfr.open_reader(p, skip_corrupt=True)
    assert len(list(r)) == kept and r.stats["skipped"] == 1 and r.stats["skipped_bytes"] > 0
    # the CLI reports the same, with status 1
    cli = subprocess.run([sys.executable, "-m", "ember", "tfrecord", "inspect", p],
                         capture_output=True, text=True)
    assert cli.returncode == 1 and want in cli.stderr
    cli = subprocess.run([sys.executable, "-m", "ember", "tfrecord", "inspect", "--skip-corrupt",
                          p], capture_output=True, text=True)
    assert cli.returncode == 0 and f"{kept} records" in cli.stdout and "skipped 1" in cli.stdout


def test_cli_inspect(tmp_path):
    p = str(tmp_path / "i.tfrecord.gz")
    _write(p, compression="gzip")
    out = subprocess.run([sys.executable, "-m", "ember", "tfrecord", "inspect", "-n", "2", p],
                         capture_output=True, text=True, check=True).stdout
    assert f"{N} records" in out and "compression gzip" in out
    assert "image: float_list, 6 value(s), in 50 record(s)" in out
    assert "label: int64_list, 1 value(s)" in out and "record 1:" in out and "[-6]" in out
    assert "name: ['rec0']" in out


def test_crc32c_and_writer_errors(tmp_path):
    assert _ember.crc32c(b"123456789") == 0xE3069283
    assert _ember.crc32c(b"56789", _ember.crc32c(b"1234")) == 0xE3069283
    with pytest.raises(ValueError, match="compression"):
        _ember.TFRecordWriter(str(tmp_path / "x"), 7)
    with pytest.raises(_ember.EmberError, match="nonexistent"):
        _ember.TFRecordWriter("/nonexistent/dir/x.tfrecord")
    with pytest.raises(ValueError, match="column 'a': 3 values for 2 rows of width 2"):
        _ember.encode_examples([("a", tfr.FLOAT, 2, np.zeros(3, np.float32), None, None, None)], 2)
    with pytest.raises(_ember.EmberError, match="column 'a', row 1: row offsets out of range"):
        _ember.encode_examples([("a", tfr.INT64, 0, np.zeros(2, np.int64), None,
                                 np.array([0, 1, 9], np.uint64), None)], 2)


def test_decoder_gather_refuses_other_index_types_and_rows_out_of_range():
    d = _ember.ExampleDecoder([("x", tfr.INT64, 1, 0)])
    with pytest.raises(TypeError, match="rows must be a contiguous int64 array, not format 'i'"):
        d.gather(np.array([0], np.int32))
    with pytest.raises(TypeError, match="not format 'd'"):
        d.gather(np.array([0.0]))
    with pytest.raises(_ember.EmberError, match=r"row 0 \(index 0\) is out of range: the decoder holds 0 rows"):
        d.gather(np.array([0], np.int64))
    assert d.gather(np.array([], np.int64))[0] == 0
