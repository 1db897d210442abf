"""main_fun bodies for the collective tests on Spark (imported by node processes).

Each node writes what it observed to ``args["out"]/coll-<index>.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List

import numpy as np

from test_collective import DTYPES, OPS, _inputs, _reference

SIZES = [0, 1, 7, 4099, 70001]


def _write(args: Dict[str, Any], ctx: Any, info: Dict[str, Any]) -> None:
    path = os.path.join(args["out"], f"coll-{ctx.worker_num}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def every_op(args: Dict[str, Any], ctx: Any) -> None:
    """Every op and dtype of ctx.allreduce against numpy, then broadcast,
    allgather and barrier; the evaluator checks that it has no collective."""
    if ctx.job_name not in ("chief", "worker"):
        try:
            ctx.allreduce(np.zeros(3, np.float32))
            error = ""
        except RuntimeError as exc:
            error = str(exc)
        _write(args, ctx, dict(role=ctx.job_name, error=error))
        return
    rank, size = ctx.collective.rank, ctx.collective.size
    failures: List[str] = []
    digest = hashlib.sha256()
    for dtype in DTYPES:
        for op in OPS:
            for n in SIZES:
                a = _inputs(rank, dtype, n, seed=7)
                if ctx.allreduce(a, op=op) is not a:
                    failures.append("allreduce did not return its array")
                want = _reference(size, dtype, n, op, seed=7)
                if np.issubdtype(dtype, np.floating):
                    tol = 1e-5 if dtype == np.float32 else 1e-12
                    ok = np.allclose(a, want, rtol=tol, atol=tol)
                else:
                    ok = np.array_equal(a, want)
                if not ok:
                    failures.append(f"allreduce {np.dtype(dtype).name} {op} n={n}")
                digest.update(a.tobytes())
    for root in range(size):
        b = np.full((3, 5), rank, dtype=np.float64)
        ctx.broadcast(b, root=root)
        if not (b == root).all():
            failures.append(f"broadcast root={root}: {b.ravel()[:3]}")
    g = ctx.allgather(np.array([rank, 10 * rank + 1], np.int64))
    if g.tolist() != [[r, 10 * r + 1] for r in range(size)]:
        failures.append(f"allgather: {g.tolist()}")
    ctx.barrier()
    errors = []
    for bad in (lambda: ctx.allreduce(np.zeros(3, np.uint8)),
                lambda: ctx.allreduce(np.zeros(3, np.float32), op="prod"),
                lambda: ctx.allreduce(np.zeros((4, 4), np.float32)[:, 1]),
                lambda: ctx.broadcast(np.zeros(3), root=size)):
        try:
            bad()
            errors.append("")
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    _write(args, ctx, dict(role=ctx.job_name, rank=rank, size=size, failures=failures,
                           digest=digest.hexdigest(), rank_env=os.environ.get("RANK"),
                           errors=errors))


def keras_fit(args: Dict[str, Any], ctx: Any) -> None:
    """Keras 3 model.fit on this node's shard of a Fashion-MNIST subset, with
    ember.keras; records a digest of the weights after every epoch."""
    os.environ.pop("TF_USE_LEGACY_KERAS", None)  # Keras 3, not tf_keras
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import ember.keras
    from examples.fashion_mnist.data import load_split

    rank, size = ctx.collective.rank, ctx.collective.size
    n = args["n"]
    images, labels = load_split("train")
    x = images[:n].reshape(n, -1).astype(np.float32) / 255.0
    y = labels[:n].astype(np.int64)
    x, y = x[rank::size], y[rank::size]  # each node trains on its own shard

    def digest() -> str:
        h = hashlib.sha256()
        for w in model.weights:
            h.update(np.ascontiguousarray(keras.ops.convert_to_numpy(w)).tobytes())
        return h.hexdigest()

    keras.utils.set_random_seed(100 + rank)  # different initial weights on each node
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dropout(0.1), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    initial = digest()
    epochs: List[str] = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            epochs.append(digest())

    callbacks = ember.keras.distribute(model, ctx) + [Record()]
    history = model.fit(x, y, batch_size=64, epochs=args["epochs"], shuffle=True,
                        callbacks=callbacks, verbose=0)
    test_x, test_y = load_split("test")
    test_x = test_x[:2000].reshape(2000, -1).astype(np.float32) / 255.0
    _, accuracy = model.evaluate(test_x, test_y[:2000].astype(np.int64), verbose=0)
    _write(args, ctx, dict(rank=rank, size=size, keras=keras.__version__,
                           legacy=os.environ.get("TF_USE_LEGACY_KERAS"),
                           shard=int(len(x)), first_label=int(y[0]), initial=initial,
                           epochs=epochs, loss=history.history["loss"],
                           accuracy=float(accuracy)))


def peer_fails(args: Dict[str, Any], ctx: Any) -> None:
    """Rank 1 raises after one allreduce; rank 0's next allreduce must fail
    fast (the failed node's collective is closed), not at its timeout."""
    import time

    from ember import _ember

    a = np.ones(1000, np.float32)
    ctx.allreduce(a)
    if ctx.collective.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    start = time.monotonic()
    try:
        ctx.allreduce(np.ones(1 << 20, np.float32), timeout=120)
        error = ""
    except _ember.EmberError as exc:
        error = f"{type(exc).__name__}: {exc}"
    _write(args, ctx, dict(rank=0, first=float(a[0]), error=error,
                           seconds=time.monotonic() - start))
