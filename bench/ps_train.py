"""bench-ps's training comparison: one wide-and-deep click model trained by
2 workers asynchronously on Ember's parameter servers (1 ps) against the
same model trained synchronously on Ember's collective (allreduce of every
gradient, the embeddings' included), records/s, on a local Spark session.

Both sides run the same Keras 3 program on the same synthetic click data
(1,000,000 items x 16 and 100,000 users x 8 embedding rows, 8 dense
features), batch 256 per worker; only the one line that distributes it
differs (``ember.keras.parameter_servers`` or ``ember.keras.distribute``).
Records/s: all the records the workers trained on over the slowest
worker's ``fit`` time.  Called by bench/ps.py (``widedeep(...)``).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ITEMS, ITEM_DIM, USERS, USER_DIM, DENSE, BATCH = 1_000_000, 16, 100_000, 8, 8, 256


def train_node(args: Dict[str, Any], ctx: Any) -> None:
    """One worker: its share of the click data, one epoch, fit timed."""
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import ember.keras

    rank = ctx.collective.rank
    rng = np.random.default_rng(rank)
    n = args["records"]
    items = rng.integers(0, ITEMS, n)
    users = rng.integers(0, USERS, n)
    dense = rng.random((n, DENSE), dtype=np.float32)
    clicks = ((items % 3 == 0) ^ (dense[:, 0] > 0.5)).astype(np.float32)
    ids = keras.Input((2,), dtype="int64")
    feats = keras.Input((DENSE,))
    item = keras.layers.Flatten()(keras.layers.Embedding(ITEMS, ITEM_DIM)(ids[:, :1]))
    user = keras.layers.Flatten()(keras.layers.Embedding(USERS, USER_DIM)(ids[:, 1:]))
    deep = keras.layers.Dense(64, activation="relu")(
        keras.layers.Concatenate()([item, user, feats]))
    model = keras.Model([ids, feats], keras.layers.Dense(1)(deep), name="widedeep")
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    if args["side"] == "async":
        callbacks = ember.keras.parameter_servers(model, ctx)
    else:
        callbacks = ember.keras.distribute(model, ctx)
    x = [np.stack([items, users], 1), dense]
    ctx.collective.barrier()  # both workers start their fit together
    start = time.perf_counter()
    model.fit(x, clicks, batch_size=BATCH, epochs=1, callbacks=callbacks, verbose=0)
    seconds = time.perf_counter() - start
    with open(os.path.join(args["out"], f"{args['side']}-{args['round']}-{rank}.json"),
              "w") as f:
        json.dump({"seconds": seconds, "records": n}, f)


def widedeep(rounds: int, quick: bool, out: str) -> Dict[str, List[float]]:
    """records/s of each side in each of ``rounds`` interleaved rounds."""
    sys.path.insert(0, HERE)
    import rounds as rounds_mod
    from pyspark.sql import SparkSession

    from ember.ps import ParameterServers
    from ember.spark import InputMode, run

    repo = os.path.dirname(HERE)
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors run this venv's Python
    spark = (SparkSession.builder.master("local[4]").appName("ember-bench-ps-train")
             .config("spark.ui.enabled", "false")
             .config("spark.pyspark.python", sys.executable)
             .config("spark.executorEnv.PYTHONPATH", os.pathsep.join([HERE, repo]))
             .getOrCreate())
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    records = 2048 if quick else 16384
    os.makedirs(out, exist_ok=True)

    def side(name: str) -> Any:
        def go() -> float:
            r = go.round  # type: ignore[attr-defined]
            go.round += 1  # type: ignore[attr-defined]
            args = {"side": name, "records": records, "out": out, "round": r}
            if name == "async":
                cluster = run(sc, train_node, args, num_executors=3, num_ps=1,
                              parameter_servers=ParameterServers(), master_node=None,
                              input_mode=InputMode.TENSORFLOW, reservation_timeout=300)
            else:
                cluster = run(sc, train_node, args, num_executors=2, master_node=None,
                              input_mode=InputMode.TENSORFLOW, reservation_timeout=300)
            cluster.shutdown(timeout=1800)
            done = [json.load(open(os.path.join(out, f"{name}-{r}-{k}.json"))) for k in (0, 1)]
            return sum(d["records"] for d in done) / max(d["seconds"] for d in done)
        go.round = 0  # type: ignore[attr-defined]
        return go

    try:
        return rounds_mod.interleaved(rounds, {"async": side("async"), "sync": side("sync")})
    finally:
        spark.stop()
