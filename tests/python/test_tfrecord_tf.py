"""Compatibility with the real TensorFlow (one module: TF takes seconds to
import).  Files written by tf.io.TFRecordWriter (plain and GZIP) read by
Ember give identical records; files written by Ember read by
tf.data.TFRecordDataset + tf.io.parse_example give identical tensors;
Examples serialized by TensorFlow decode identically, including empty lists,
negative int64, NaN/inf floats and large bytes values."""

from __future__ import annotations

import numpy as np
import pytest

import ember.tfrecord as tfr
from ember import _ember

tf = pytest.importorskip("tensorflow")

BIG = bytes(range(256)) * 4096 * 3  # 3 MiB


def _tf_examples():
    feats = []
    for i in range(20):
        f = {
            "f": tf.train.Feature(float_list=tf.train.FloatList(
                value=[float("nan"), float("inf"), -float("inf"), -0.0, 1e-38, i + 0.5])),
            "i": tf.train.Feature(int64_list=tf.train.Int64List(
                value=[-(2 ** 63), -1, 2 ** 63 - 1, i])),
            "b": tf.train.Feature(bytes_list=tf.train.BytesList(
                value=[b"", b"\x00\xff", BIG if i == 3 else b"x" * i])),
            "e_f": tf.train.Feature(float_list=tf.train.FloatList(value=[])),
            "e_i": tf.train.Feature(int64_list=tf.train.Int64List(value=[])),
            "e_b": tf.train.Feature(bytes_list=tf.train.BytesList(value=[])),
            "var": tf.train.Feature(int64_list=tf.train.Int64List(value=list(range(i % 4)))),
        }
        feats.append(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
    return feats


@pytest.mark.parametrize("compression", ["", "GZIP"])
def test_tf_writer_ember_reader(tmp_path, compression):
    p = str(tmp_path / "tf.tfrecord")
    recs = _tf_examples() + [b"", b"raw \x00 bytes"]
    with tf.io.TFRecordWriter(p, options=compression or None) as w:
        for r in recs:
            w.write(r)
    assert tfr.detect_compression(p) == (1 if compression else 0)
    assert list(tfr.open_reader(p)) == recs


def test_tf_examples_decode_identically(tmp_path):
    recs = _tf_examples()
    spec = {"f": tf.io.FixedLenFeature([6], tf.float32), "i": tf.io.FixedLenFeature([4], tf.int64),
            "b": tf.io.FixedLenFeature([3], tf.string),
            "e_f": tf.io.VarLenFeature(tf.float32), "e_i": tf.io.VarLenFeature(tf.int64),
            "e_b": tf.io.VarLenFeature(tf.string), "var": tf.io.RaggedFeature(tf.int64)}
    want = tf.io.parse_example(tf.constant(recs), spec)
    d = _ember.ExampleDecoder([("f", 2, 6, 0), ("i", 3, 4, 0), ("b", 1, 3, 0), ("e_f", 2, 0, 0),
                               ("e_i", 3, 0, 0), ("e_b", 1, 0, 0), ("var", 3, 0, 0)])
    for r in recs:
        d.add(r)
    n, cols = d.take()
    assert n == len(recs)
    f = np.asarray(cols[0][0]).reshape(n, 6)
    np.testing.assert_array_equal(f.view(np.uint32), want["f"].numpy().view(np.uint32))
    np.testing.assert_array_equal(np.asarray(cols[1][0]).reshape(n, 4), want["i"].numpy())
    data, offs = bytes(cols[2][0]), np.asarray(cols[2][1])
    got_b = [data[offs[k]:offs[k + 1]] for k in range(len(offs) - 1)]
    assert got_b == list(want["b"].numpy().reshape(-1))
    for k, name in ((3, "e_f"), (4, "e_i"), (5, "e_b")):
        assert np.asarray(cols[k][2]).tolist() == [0] * (n + 1)
        assert want[name].values.shape[0] == 0
    assert np.asarray(cols[6][2]).tolist() == want["var"].row_splits.numpy().tolist()
    assert np.asarray(cols[6][0]).tolist() == want["var"].values.numpy().tolist()
    # the generic parser agrees on kinds and counts
    p = _ember.example_parse(recs[3])
    assert p["b"][1][2] == BIG and p["e_f"] == (2, b"") and p["e_b"] == (1, [])


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_ember_writer_tf_reader(tmp_path, compression):
    p = str(tmp_path / "e.tfrecord")
    rng = np.random.default_rng(0)
    img = rng.random((30, 784), dtype=np.float32)
    img[0, :3] = [np.nan, np.inf, -np.inf]
    lab = rng.integers(-(2 ** 63), 2 ** 63 - 1, 30, dtype=np.int64)
    names = [b"x" * i for i in range(29)] + [BIG]
    tfr.write(p, {"image": img, "label": lab, "name": names}, compression)
    ds = tf.data.TFRecordDataset(p, compression_type="GZIP" if compression else "")
    raw = [r.numpy() for r in ds]
    assert raw == list(tfr.open_reader(p))
    spec = {"image": tf.io.FixedLenFeature([784], tf.float32),
            "label": tf.io.FixedLenFeature([], tf.int64),
            "name": tf.io.FixedLenFeature([], tf.string)}
    got = next(iter(ds.batch(30).map(lambda x: tf.io.parse_example(x, spec))))
    np.testing.assert_array_equal(got["image"].numpy().view(np.uint32), img.view(np.uint32))
    np.testing.assert_array_equal(got["label"].numpy(), lab)
    assert list(got["name"].numpy()) == names
    # and the tf.data adapter yields the same tensors
    b = next(iter(tfr.dataset(p, 30, {"image": ("float32", 784), "label": "int64"})))
    np.testing.assert_array_equal(b["label"].numpy(), lab)
    assert b["image"].shape == (30, 784)
