"""make bench-tf-feed: Keras training from the feed, by Ember's TensorFlow op
against TensorFlowOnSpark's way, and against the limit.

What it measures: records/s of ``model.fit`` on one node, one epoch of
Fashion-MNIST's 60,000 training images, the main job's model (784-256-128-10,
Adam 1e-3) at the main job's batch of 64 per node, Keras 3 on TensorFlow.
The sides, each in its best configuration:

* ``op``: ``ember.tf.feed_dataset(server, 64)``: batches made by Ember's op in
  C (``_tf_feed_op.c``), in TensorFlow's threads, no Python per batch.
* ``generator``: ``tf.data.Dataset.from_generator`` over ``DataFeed.next_batch``
  (with the copy TensorFlow needs, since a batch's arrays view the feed's
  memory), as TensorFlowOnSpark's Keras examples feed ``model.fit``, with
  ``prefetch(AUTOTUNE)``.
* ``limit``: ``model.fit`` on the same rows from in-memory arrays, what the
  cores compute with no feed at all.

For ``op`` and ``generator`` a producer process (as Spark's feeding task is)
pushes the rows into an in-process feed server over shared memory, in 4
partitions of 1,000-row batches; it loads its rows before the clock and
sends from the clock's start.  The limit has no producer.  Each side keeps one compiled model across rounds, traced by
a one-batch fit before the first round, so the clock measures steady
training.  Rounds are interleaved (bench/rounds.py), median [min-max].

EMBER_BENCH_QUICK=1: 6,400 rows, one round.
Ends with ``RESULT tf_feed op_vs_generator=<x> op_vs_limit=<x> ...``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Dict, List

import numpy as np

import rounds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
SECRET = b"bench-tf-feed-secret-0123456789ab"
BATCH = 64
PARTITIONS = 4
CHUNK = 1000


def _rows(n: int) -> Any:
    from examples.fashion_mnist.data import load_split

    images, labels = load_split("train")
    x = images[:n].reshape(n, -1).astype(np.float32) / 255.0
    return x, labels[:n].astype(np.int64)


def produce(port: int, n: int, call: int) -> None:
    """The feeding task: n rows in PARTITIONS partitions over shared memory."""
    from ember import _columns, _ember

    x, y = _rows(n)
    per = n // PARTITIONS
    print("ready", flush=True)
    sys.stdin.readline()  # the clock starts
    for p in range(PARTITIONS):
        with _ember.FeedClient("127.0.0.1", port, SECRET, p, timeout_s=120.0, call=call,
                               call_partitions=PARTITIONS) as c:
            for lo in range(p * per, (p + 1) * per, CHUNK):
                hi = min(lo + CHUNK, (p + 1) * per)
                specs = [_columns.array_column("x", x[lo:hi]), _columns.array_column("y", y[lo:hi])]
                c.send(specs, hi - lo, 120.0)
            c.end_partition(120.0)


def _model() -> Any:
    import keras

    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _rows(BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # traced before any clock
    return model


def main() -> int:
    quick = os.environ.get("EMBER_BENCH_QUICK") == "1"
    n = 6400 if quick else 60000
    nrounds = 1 if quick else 3
    import tensorflow as tf

    from ember import _ember
    from ember import tf as ember_tf
    from ember.node import DataFeed

    x, y = _rows(n)
    server = _ember.FeedServer(SECRET, host="127.0.0.1")
    models = {side: _model() for side in ("op", "generator", "limit")}
    calls = iter(range(1, 1000))

    def feeding() -> Any:
        """A producer with its rows loaded, waiting for the word to send."""
        producer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--produce",
                                     str(server.port), str(n), str(next(calls))],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert producer.stdout is not None and producer.stdout.readline().strip() == "ready"
        return producer

    def fed_fit(side: str, make_ds: Any) -> float:
        producer = feeding()
        t0 = time.perf_counter()
        producer.stdin.write("go\n")
        producer.stdin.flush()
        models[side].fit(make_ds(), epochs=1, verbose=0)
        seconds = time.perf_counter() - t0
        if producer.wait(60) != 0:
            raise RuntimeError(f"{side}: the producer failed")
        return n / seconds

    def op() -> float:
        made: List[Any] = []

        def make() -> Any:
            made.append(ember_tf.feed_dataset(server, BATCH))
            return made[-1].prefetch(tf.data.AUTOTUNE)
        try:
            return fed_fit("op", make)
        finally:  # its reader must not take the next side's rows
            for ds in made:
                ds._ember_feed_reader.close()

    def generator() -> float:
        feed = DataFeed(server, train_mode=True)

        def batches() -> Any:
            while True:
                batch = feed.next_batch(BATCH)
                if len(batch) == 0:
                    return
                bx, by = batch.columns
                yield np.array(bx), np.array(by)
        sig = (tf.TensorSpec([None, 784], tf.float32), tf.TensorSpec([None], tf.int64))
        return fed_fit("generator", lambda: tf.data.Dataset.from_generator(
            batches, output_signature=sig).prefetch(tf.data.AUTOTUNE))

    def limit() -> float:
        t0 = time.perf_counter()
        models["limit"].fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        return n / (time.perf_counter() - t0)

    def report(r: int, side: str, rps: float, seconds: float) -> None:
        print(f"round {r}: {side:9s} {rps:10,.0f} records/s", flush=True)

    got = rounds.interleaved(nrounds, {"op": op, "generator": generator, "limit": limit},
                             report=report)
    server.close()
    med = {side: rounds.spread(v).median for side, v in got.items()}
    print()
    for side, values in got.items():
        print(f"{side:9s} {rounds.fmt_spread(values, ',.0f')} records/s")
    print(f"\nRESULT tf_feed op_vs_generator={med['op'] / med['generator']:.3f} "
          f"op_vs_limit={med['op'] / med['limit']:.3f} op_rps={med['op']:.0f} "
          f"generator_rps={med['generator']:.0f} limit_rps={med['limit']:.0f} "
          f"records={n} batch={BATCH} rounds={nrounds}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--produce":
        produce(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    sys.exit(main())
