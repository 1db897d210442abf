"""Node functions of the parameter-server tests (test_ps_spark.py): they run in
the nodes of an ``ember.spark.run(..., parameter_servers=...)`` cluster and
write what they saw to ``<out>/<role>-<task>.json``."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict

import numpy as np


def _keras() -> Any:
    os.environ.pop("TF_USE_LEGACY_KERAS", None)  # Keras 3, not tf_keras
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    return keras


def _write(args: Dict[str, Any], ctx: Any, info: Dict[str, Any]) -> None:
    path = os.path.join(args["out"], f"{ctx.job_name}-{ctx.task_index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict(info, role=ctx.job_name, task=ctx.task_index, pid=os.getpid()), f)
    os.replace(path + ".tmp", path)


def keras_async(args: Dict[str, Any], ctx: Any) -> None:
    """A Fashion-MNIST MLP trained asynchronously with Adam on the parameter
    servers (each worker its own shard), then a click model whose 1,000,000-row
    embedding table lives on them row-sparse; writes the accuracies and the
    bytes each part moved."""
    keras = _keras()
    import ember.keras
    from examples.fashion_mnist.data import load_split

    ps = ctx.parameter_servers(timeout=120)
    rank, size = ps.worker, ps.num_workers
    n = args["n"]
    images, labels = load_split("train")
    x = images[:n].reshape(n, -1).astype(np.float32) / 255.0
    y = labels[:n].astype(np.int64)
    x, y = x[rank::size], y[rank::size]
    keras.utils.set_random_seed(100 + rank)  # different starts: the chief's must win
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)], name="mlp")
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = ember.keras.parameter_servers(model, ctx)
    start = [float(np.sum(keras.ops.convert_to_numpy(w))) for w in model.trainable_weights]
    history = model.fit(x, y, batch_size=64, epochs=args["epochs"], callbacks=callbacks,
                        verbose=0)
    final = [float(np.sum(keras.ops.convert_to_numpy(w))) for w in model.trainable_weights]
    test_x, test_y = load_split("test")
    test_x = test_x[:2000].reshape(2000, -1).astype(np.float32) / 255.0
    _, accuracy = model.evaluate(test_x, test_y[:2000].astype(np.int64), verbose=0)
    mlp_bytes = ps.bytes()

    # clicks: the label is whether the item id is even; only a sparse
    # embedding of the id can learn it (the user's, a Keras Embedding the
    # servers hold row-sparse too, is noise)
    rows, dim, batches, batch = 1_000_000, 8, 60, 128
    rng = np.random.default_rng(rank)
    items = rng.integers(0, 2000, size=batches * batch) * 499  # 2,000 ids spread over 1M
    users = rng.integers(0, 1000, size=batches * batch)
    clicks = (items % 2 == 0).astype(np.float32)
    inputs = keras.Input((2,), dtype="int64")
    item = ember.keras.PsEmbedding(rows, dim, learning_rate=0.3, name="items")(inputs[:, :1])
    user = keras.layers.Embedding(1000, 4, name="users")(inputs[:, 1:])
    joined = keras.layers.Concatenate()([keras.layers.Flatten()(item),
                                         keras.layers.Flatten()(user)])
    clicker = keras.Model(inputs, keras.layers.Dense(1)(joined), name="clicks")
    clicker.compile(optimizer=keras.optimizers.SGD(0.1),
                    loss=keras.losses.BinaryCrossentropy(from_logits=True), metrics=["accuracy"])
    callbacks = ember.keras.parameter_servers(clicker, ctx)
    before = ps.bytes()
    clicks_history = clicker.fit(np.stack([items, users], 1), clicks, batch_size=batch,
                                 epochs=3, callbacks=callbacks, verbose=0)
    after = ps.bytes()
    _write(args, ctx, dict(
        rank=rank, size=size, shards=ps.num_shards, start=start, final=final,
        loss=history.history["loss"], accuracy=float(accuracy), mlp_bytes=list(mlp_bytes),
        clicks_accuracy=float(clicks_history.history["accuracy"][-1]),
        clicks_received=after[1] - before[1], clicks_sent=after[0] - before[0],
        users_on_servers=getattr(clicker.get_layer("users"), "_ember_ps_table", None),
        transports=ps.transports,
        clicks_steps=3 * batches, distinct_items=int(len(np.unique(items))),
        table_bytes=rows * dim * 4, at=time.time()))


def fmnist_steps(args: Dict[str, Any], ctx: Any) -> None:
    """Fashion-MNIST (an MLP of 128 hidden units, Adam) trained on the
    parameter servers, each worker its shard; notes its pid first (so
    the test can freeze it) and the wall-clock time of every step, then its
    test accuracy, in ``<out>/<phase>-<rank>.json``."""
    keras = _keras()
    import ember.keras
    from examples.fashion_mnist.data import load_split

    ps = ctx.parameter_servers(timeout=120)
    rank, size = ps.worker, ps.num_workers
    phase = args["phase"]
    with open(os.path.join(args["out"], f"pid-{phase}-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    n = args["n"]
    images, labels = load_split("train")
    x = images[:n].reshape(n, -1).astype(np.float32) / 255.0
    y = labels[:n].astype(np.int64)
    x, y = x[rank::size], y[rank::size]
    # 784-128-10, not the main job's 784-256-128-10: 101,770 weights to pull
    # and push a step instead of 235,146 (about half the CPU a step)
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)], name="fmnist")
    # Adam at 1e-3: at 2e-3 the servers' final weights once scored 0.8255
    # (bounded, on CI) against 0.85-0.87 in other runs: the last steps' noise
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = ember.keras.parameter_servers(model, ctx)
    steps: list = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            steps.append(time.time())
            if len(steps) == 10:  # training runs: the test may freeze this worker now
                open(os.path.join(args["out"], f"started-{phase}-{rank}"), "w").close()

    model.fit(x, y, batch_size=64, epochs=args["epochs"], callbacks=[Steps(), *callbacks],
              verbose=0)
    test_x, test_y = load_split("test")
    test_x = test_x.reshape(len(test_x), -1).astype(np.float32) / 255.0
    _, accuracy = model.evaluate(test_x, test_y.astype(np.int64), batch_size=1000, verbose=0)
    info = dict(rank=rank, accuracy=float(accuracy), steps=steps)
    path = os.path.join(args["out"], f"{phase}-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def keras_restart(args: Dict[str, Any], ctx: Any) -> None:
    """An MLP on the parameter servers, killed and restarted: each attempt
    notes the test accuracy of the weights it starts from (the servers',
    after ``parameter_servers``) and of those it ends with."""
    keras = _keras()
    import ember.keras
    from examples.fashion_mnist.data import load_split

    attempt = int(os.environ.get("EMBER_RESTART", "0"))
    ps = ctx.parameter_servers(timeout=120)
    rank, size = ps.worker, ps.num_workers
    images, labels = load_split("train")
    n = args["n"]
    x = images[:n].reshape(n, -1).astype(np.float32) / 255.0
    y = labels[:n].astype(np.int64)
    x, y = x[rank::size], y[rank::size]
    test_x, test_y = load_split("test")
    test_x = test_x[:2000].reshape(2000, -1).astype(np.float32) / 255.0
    test_y = test_y[:2000].astype(np.int64)
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)], name="restart")
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = ember.keras.parameter_servers(model, ctx)
    _, start = model.evaluate(test_x, test_y, verbose=0)
    seen: list = []

    class Marks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            seen.append(batch)
            if len(seen) == 10:
                open(os.path.join(args["out"], f"started-{attempt}-{rank}"), "w").close()
            if attempt == 0:
                time.sleep(0.03)  # long enough for the test to kill a ps mid-way

    model.fit(x, y, batch_size=64, epochs=args["epochs"], callbacks=[Marks(), *callbacks],
              verbose=0)
    _, end = model.evaluate(test_x, test_y, verbose=0)
    path = os.path.join(args["out"], f"attempt-{attempt}-{rank}.json")
    with open(path, "w") as f:
        json.dump(dict(start=float(start), end=float(end), steps=len(seen)), f)


def _tf_pss_node(ctx: Any) -> Any:
    """TensorFlow for a ParameterServerStrategy node: the ps and worker nodes
    serve (ember.ps.tensorflow_server) and get None; the chief gets tf."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from ember import ps

    if ctx.job_name in ("ps", "worker"):
        ps.tensorflow_server(ctx)
        return None
    return tf


def _tf_pss_fit(args: Dict[str, Any], tf: Any, dataset_fn: Any) -> None:
    """The chief's part, as TensorFlow's tutorial writes it: the main job's
    model fit over dataset_fn through a ClusterCoordinator; writes the test
    accuracy and the number of workers to <out>/chief.json."""
    import tf_keras as keras

    from examples.fashion_mnist.data import load_split

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = keras.Sequential([keras.Input((784,)),
                                  keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=10)
    model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=args["epochs"],
              steps_per_epoch=args["steps"], verbose=0)
    test_x, test_y = load_split("test")
    test_x = test_x[:2000].reshape(2000, -1).astype(np.float32) / 255.0
    logits = model(test_x, training=False).numpy()
    accuracy = float((logits.argmax(1) == test_y[:2000]).mean())
    with open(os.path.join(args["out"], "chief.json"), "w") as f:
        json.dump(dict(accuracy=accuracy, workers=len(resolver.cluster_spec().as_dict()
                                                      .get("worker", []))), f)


def tf_parameter_server_strategy(args: Dict[str, Any], ctx: Any) -> None:
    """TensorFlow's ParameterServerStrategy (tf_keras) as its users write it:
    the chief coordinates model.fit over a dataset_fn that each worker runs
    on its TFRecord shard."""
    tf = _tf_pss_node(ctx)
    if tf is None:
        return
    files = sorted(os.path.join(args["data"], f) for f in os.listdir(args["data"])
                   if f.endswith(".tfrecord"))
    spec = {"image": tf.io.FixedLenFeature([784], tf.float32),
            "label": tf.io.FixedLenFeature([1], tf.int64)}

    def dataset_fn(input_context: Any) -> Any:
        shard = files[input_context.input_pipeline_id::input_context.num_input_pipelines]
        ds = tf.data.TFRecordDataset(shard).repeat().shuffle(2048)
        ds = ds.batch(input_context.get_per_replica_batch_size(64))
        return ds.map(lambda r: (lambda e: (e["image"], e["label"]))(
            tf.io.parse_example(r, spec))).prefetch(2)

    _tf_pss_fit(args, tf, dataset_fn)


def tf_parameter_server_strategy_fed(args: Dict[str, Any], ctx: Any) -> None:
    """TensorFlow's ParameterServerStrategy in InputMode.SPARK: each worker's
    dataset_fn reads the rows Spark feeds it through Ember's TensorFlow op
    (ember.tf.feed_dataset), which a from_generator dataset cannot do
    there (tensorflow#48957)."""
    tf = _tf_pss_node(ctx)
    if tf is None:
        return
    from ember import tf as ember_tf

    spec = (tf.TensorSpec([None, 784], tf.float32), tf.TensorSpec([None], tf.int64))

    def dataset_fn(input_context: Any) -> Any:
        return ember_tf.feed_dataset(None, args["batch"], element_spec=spec)

    _tf_pss_fit(args, tf, dataset_fn)


# ------------------------------------------------------------ the tests' side

def train_async_on_two_shards(sc: Any, main_fun: Any, out: str,
                              embedding_floats: int) -> Dict[str, Dict[str, Any]]:
    """Runs ``main_fun`` (keras_async, or torch_psfuns.torch_async) on a
    chief and a worker with 2 ps shards, checks what both frameworks must
    show, and returns the two nodes' reports by role.  ``embedding_floats``:
    the floats of the embedding rows one click record pulls."""
    from conftest import read_json_files
    from ember.ps import ParameterServers
    from ember.spark import InputMode, run

    cluster = run(sc, main_fun, {"out": out, "n": 8192, "epochs": 3}, num_executors=4,
                  num_ps=2, parameter_servers=ParameterServers(),
                  input_mode=InputMode.TENSORFLOW, reservation_timeout=120)
    cluster.shutdown(timeout=300)
    chief, worker = sorted(read_json_files(out), key=lambda i: i["rank"])
    assert (chief["role"], worker["role"]) == ("chief", "worker")
    for node in (chief, worker):
        assert (node["size"], node["shards"]) == (2, 2)
        assert node["loss"][-1] < node["loss"][0]
        assert node["accuracy"] > 0.75, node["accuracy"]
        # the click model learned from its embedding rows alone
        assert node["clicks_accuracy"] > 0.9, node["clicks_accuracy"]
        # each step pulled the rows of its batch (at most 128 records) and
        # the click model's dense weights, never the 32 MB table
        per_step = node["clicks_received"] / node["clicks_steps"]
        assert 0 < per_step < 128 * embedding_floats * 4 + 4096, per_step
        assert node["clicks_received"] < node["table_bytes"] / 20
    # both started from the chief's weights, whatever their own seeds, and
    # ended with the servers' final weights
    assert chief["start"] == worker["start"]
    assert chief["final"] == worker["final"] != chief["start"]
    return {"chief": chief, "worker": worker}
