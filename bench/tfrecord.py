"""TFRecord benchmark: reading and parsing Fashion-MNIST Examples into dense
batches, Ember vs tf.data, plus CRC-32C and Example-decoder microbenchmarks.

* Data: the Fashion-MNIST train set (60,000 Examples: "image" 784 float32
  in [0, 1], "label" int64), written once by Ember as an uncompressed TFRecord
  file (about 190 MB) and read as the same file listed R times, R chosen so
  that the total is >= 1 GB.  The file is read once before timing, so both
  readers are served from the page cache.
* Ember: ``ember.tfrecord.reader(files, B, {"image": ("float32", 784),
  "label": "int64"})`` -- C framing, CRC-32C checks of every record, decoding
  into columns, numpy batches; one thread.
* tf.data: ``TFRecordDataset(files).batch(B).map(tf.io.parse_example,
  AUTOTUNE).prefetch(AUTOTUNE)`` (TensorFlow's recommended form, also CRC
  checked), iterated eagerly to numpy, same batch size B, same process.
* ROUNDS (3) interleaved rounds (bench/rounds.py): each round reads the
  whole set once with Ember and once with tf.data (which one goes first
  alternates from round to round), and every round's seconds are kept.
  Each reader is reported as its median GB/s and [min-max] over the rounds,
  GB/s = 1e9 bytes/s of TFRecord file bytes; the headline ratio is median
  Ember / median tf.data.
* CRC-32C: ``build/bench/crc32c`` -- ember_crc32c against a bare loop of
  three independent crc32 instruction streams (the instruction's limit).
  That C program reports each loop's best of 5 timed rounds of ~0.2 s.
* Example decoding: ``build/bench/example_decode`` -- Ember's decoder vs
  protobuf-c's generated one (+ copying into columns), on the same records;
  the figure behind the choice in csrc/example.c.  That C program reports
  each decoder's best of 3 passes (Ember's 3, then protobuf-c's 3), not
  interleaved.

EMBER_BENCH_QUICK=1 (make bench-smoke): the first QUICK_ROWS Examples and a
~50 MB total instead (CRC-32C rounds shortened likewise); the same readers,
rounds, checks and figures.

Last line: ``RESULT tfrecord ember_gbps=<x> tfdata_gbps=<y>
ratio_vs_tfdata=<x/y> crc_gbps=<c> crc_limit_gbps=<l> ember_gbps_min=...
ember_gbps_max=... tfdata_gbps_min=... tfdata_gbps_max=... rounds=<n>``
(ember_gbps and tfdata_gbps the medians).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np

import rounds  # bench/rounds.py (bench/ is this script's path)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
BATCH = 1024
ROUNDS = 3  # interleaved rounds, each reader once per round
TARGET_BYTES = 1_000_000_000
QUICK = os.environ.get("EMBER_BENCH_QUICK", "") not in ("", "0")
QUICK_ROWS = 8192
if QUICK:
    TARGET_BYTES = 50_000_000
WORK = os.path.join(REPO, "build", "bench")


def main() -> None:
    from examples.fashion_mnist.data import load_split

    import ember.tfrecord as tfr

    os.makedirs(WORK, exist_ok=True)
    path = os.path.join(WORK, "fashion_mnist_train.tfrecord")
    images, labels = load_split("train")
    if QUICK:
        images, labels = images[:QUICK_ROWS], labels[:QUICK_ROWS]
    n = len(labels)
    t0 = time.perf_counter()
    tfr.write(path, {"image": images.reshape(n, 784).astype(np.float32) / 255.0,
                     "label": labels.astype(np.int64)})
    write_s = time.perf_counter() - t0
    size = os.path.getsize(path)
    reps = max(1, math.ceil(TARGET_BYTES / size))
    files: List[str] = [path] * reps
    total = size * reps
    with open(path, "rb") as f:  # into the page cache
        while f.read(1 << 24):
            pass
    print(f"data: {n} Examples, {size / 1e6:.1f} MB file x {reps} = {total / 1e9:.2f} GB; "
          f"batch {BATCH}; Ember wrote the file in {write_s:.2f} s")

    cols = {"image": ("float32", 784), "label": "int64"}

    def ember_run() -> int:
        rows = 0
        for b in tfr.reader(files, BATCH, cols):
            rows += len(b["label"])
            assert b["image"].shape[1] == 784
        assert rows == n * reps, rows
        return rows

    import tensorflow as tf

    spec = {"image": tf.io.FixedLenFeature([784], tf.float32),
            "label": tf.io.FixedLenFeature([], tf.int64)}
    ds = (tf.data.TFRecordDataset(files).batch(BATCH)
          .map(lambda x: tf.io.parse_example(x, spec), num_parallel_calls=tf.data.AUTOTUNE)
          .prefetch(tf.data.AUTOTUNE))

    def tf_run() -> int:
        rows = 0
        for b in ds.as_numpy_iterator():
            rows += len(b["label"])
        assert rows == n * reps, rows
        return rows

    print(f"{ROUNDS} interleaved rounds", flush=True)
    # each reader's seconds per round, kept by report (the readers return rows)
    secs: Dict[str, List[float]] = {"ember": [], "tf.data": []}

    def report(r: int, name: str, _rows: int, s: float) -> None:
        secs[name].append(s)
        print(f"  round {r + 1}/{ROUNDS}: {name}: {s:.2f} s = {total / s / 1e9:.2f} GB/s",
              flush=True)

    rounds.interleaved(ROUNDS, {"ember": ember_run, "tf.data": tf_run}, report=report)

    crc = dict(kv.split("=") for kv in subprocess.run(
        [os.path.join(WORK, "crc32c")], check=True, capture_output=True,
        text=True).stdout.split())
    dec = dict(kv.split("=") for kv in subprocess.run(
        [os.path.join(WORK, "example_decode"), path, "image", "label", "784"], check=True,
        capture_output=True, text=True).stdout.split())

    gbps = {k: [total / s / 1e9 for s in v] for k, v in secs.items()}
    med = {k: rounds.spread(v).median for k, v in gbps.items()}
    ember_gbps, tf_gbps = med["ember"], med["tf.data"]
    print()
    print(f"{'reader':<44}{'median s':>10}{'median GB/s':>13}{'[min-max] GB/s':>17}"
          f"{'median records/s':>18}")
    for name, label in (("ember", "Ember reader (C, CRC checked, 1 thread)"),
                        ("tf.data", "tf.data TFRecordDataset + parse_example")):
        print(f"{label:<44}{rounds.spread(secs[name]).median:>10.2f}{med[name]:>13.2f}"
              f"{rounds.fmt_range(gbps[name], '.2f'):>17}"
              f"{n * reps / rounds.spread(secs[name]).median:>18,.0f}")
    print(f"ratio Ember / tf.data (of medians): {ember_gbps / tf_gbps:.2f}x; "
          f"{ROUNDS} interleaved rounds; GB/s = 1e9 bytes/s of TFRecord file bytes")
    print()
    print(f"CRC-32C: ember_crc32c {crc['crc_gbps']} GB/s, bare 3-stream crc32 loop "
          f"{crc['crc_limit_gbps']} GB/s "
          f"({100 * float(crc['crc_gbps']) / float(crc['crc_limit_gbps']):.0f}%), "
          f"portable {crc['portable_gbps']} GB/s (hw={crc['hw']})")
    print(f"Example decode into columns ({dec['records']} records): Ember {dec['ember_gbps']} GB/s,"
          f" protobuf-c {dec['protobuf_c_gbps']} GB/s "
          f"({float(dec['ember_gbps']) / float(dec['protobuf_c_gbps']):.1f}x)")
    print(f"RESULT tfrecord ember_gbps={ember_gbps:.2f} tfdata_gbps={tf_gbps:.2f} "
          f"ratio_vs_tfdata={ember_gbps / tf_gbps:.2f} crc_gbps={float(crc['crc_gbps']):.2f} "
          f"crc_limit_gbps={float(crc['crc_limit_gbps']):.2f} "
          f"ember_gbps_min={min(gbps['ember']):.2f} ember_gbps_max={max(gbps['ember']):.2f} "
          f"tfdata_gbps_min={min(gbps['tf.data']):.2f} "
          f"tfdata_gbps_max={max(gbps['tf.data']):.2f} rounds={ROUNDS}")


if __name__ == "__main__":
    main()
