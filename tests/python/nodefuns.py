"""main_fun bodies used by the integration tests (imported by node processes).

Each writes what it observed to ``args["out"]/node-<index>.json`` so the test
can assert on real outputs after ``shutdown()``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Dict, Tuple


def _write(args: Dict[str, Any], ctx: Any, **extra: Any) -> None:
    info = dict(index=ctx.worker_num, job_name=ctx.job_name, task_index=ctx.task_index,
                num_workers=ctx.num_workers, cluster_spec=ctx.cluster_spec,
                tf_config=os.environ.get("TF_CONFIG"), pid=os.getpid(), ports=ctx.ports,
                host=ctx.host, executor_id=ctx.executor_id,
                torch_env={k: os.environ.get(k) for k in
                           ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")},
                spark_executor=ctx.nodes[ctx.worker_num]["executor_id"],
                pyspark_imported="pyspark" in sys.modules, **extra)
    path = os.path.join(args["out"], f"node-{ctx.worker_num}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def report_ctx(args: Dict[str, Any], ctx: Any) -> None:
    _write(args, ctx)


def raise_on_node(args: Dict[str, Any], ctx: Any) -> None:
    if ctx.worker_num == args["bad"]:
        raise ValueError(f"boom from node {ctx.worker_num}")
    _write(args, ctx)


def count_records(args: Dict[str, Any], ctx: Any) -> None:
    """Consumes the whole feed; records which ids arrived, in what batch sizes and
    epochs (``feed.epoch``)."""
    feed = ctx.get_data_feed()
    ids, sizes, stamps, epochs = [], [], [], []
    while not feed.should_stop():
        batch = feed.next_batch(args.get("batch", 32))
        if len(batch) == 0:
            break
        ids.extend(int(i) for i in batch.columns[0])
        sizes.append(len(batch))
        epochs.append(feed.epoch)
        stamps.append((time.monotonic(), len(ids)))  # CLOCK_MONOTONIC: one clock per host
        if args.get("check_rows"):
            rec = batch[0]
            assert float(rec[1][0]) == float(rec[0]), rec
    if args.get("slow"):
        time.sleep(args["slow"])
    _write(args, ctx, ids=ids, sizes=sizes, stamps=stamps, epochs=epochs,
           errors=feed.producer_errors)


def train_then_raise(args: Dict[str, Any], ctx: Any) -> None:
    feed = ctx.get_data_feed()
    feed.next_batch(10)
    raise RuntimeError("trainer exploded after its first batch")


def double_it(args: Dict[str, Any], ctx: Any) -> None:
    """Inference: answers each record (id, value) with [id, 2 * value]."""
    feed = ctx.get_data_feed(train_mode=False)
    while not feed.should_stop():
        batch = feed.next_batch(args.get("batch", 50))
        if len(batch) == 0:
            break
        ids, values = batch.columns
        feed.batch_results([[int(i), 2 * float(v)] for i, v in zip(ids, values)])


def double_then_raise(args: Dict[str, Any], ctx: Any) -> None:
    """Inference: answers its first batch as double_it does, then raises."""
    feed = ctx.get_data_feed(train_mode=False)
    ids, values = feed.next_batch(10).columns
    feed.batch_results([[int(i), 2 * float(v)] for i, v in zip(ids, values)])
    raise RuntimeError("the model blew up after its first batch")


def slow_partitions(seconds: float) -> Any:
    """RDD mapPartitionsWithIndex: each partition waits ``seconds`` before its
    first record (time for a test to cancel the job)."""
    def gen(index: int, records: Any) -> Any:
        time.sleep(seconds)
        yield from records
    return gen


def sleep_in_feed(args: Dict[str, Any], ctx: Any) -> None:
    """Reads a little, then keeps reading slowly: lets a test kill it mid-training."""
    feed = ctx.get_data_feed()
    _write(args, ctx)
    while not feed.should_stop():
        if len(feed.next_batch(8)) == 0:
            break
        time.sleep(0.05)


def wait_for_feed_end(args: Dict[str, Any], ctx: Any) -> None:
    """Chief/worker: drain the feed until shutdown ends it; ps: return at once."""
    _write(args, ctx)
    if ctx.job_name in ("chief", "worker"):
        feed = ctx.get_data_feed()
        while not feed.should_stop():
            if len(feed.next_batch(64)) == 0:
                break


def collect_columns(args: Dict[str, Any], ctx: Any) -> None:
    """Consumes the feed of a DataFrame; records ids, column names/dtypes/shapes
    and whether every column agrees with the id it came with."""
    import numpy as np

    feed = ctx.get_data_feed()
    ids, layout, bad = [], None, []
    while not feed.should_stop():
        batch = feed.next_batch(args.get("batch", 100))
        if len(batch) == 0:
            break
        cols = {name: batch.column(name) for name in batch.names}
        layout = {name: [str(np.asarray(c).dtype) if not isinstance(c, list) else "list",
                         list(np.asarray(c).shape[1:]) if not isinstance(c, list) else []]
                  for name, c in cols.items()}
        for j, i in enumerate(cols["id"].tolist()):
            ids.append(i)
            if "image" in cols and cols["image"][j].reshape(-1).tolist() != [i * 0.5] * 4:
                bad.append(("image", i))
            if "name" in cols and cols["name"][j] != f"r{i}":
                bad.append(("name", i))
            if "vec" in cols and cols["vec"][j].tolist() != [float(i), 1.0]:
                bad.append(("vec", i))
    _write(args, ctx, ids=ids, layout=layout, bad=bad[:10])


def fail_first_attempt(marker_dir: str, partition: int, after: int) -> Any:
    """RDD mapPartitionsWithIndex: partition ``partition`` raises on its first
    attempt after yielding ``after`` records (a feeding task lost half-way)."""
    def gen(index: int, records: Any) -> Any:
        from pyspark import TaskContext

        first = TaskContext.get().attemptNumber() == 0
        for n, record in enumerate(records):
            if first and index == partition and n == after:
                open(os.path.join(marker_dir, f"failed-{index}"), "w").close()
                raise RuntimeError(f"injected failure of partition {index} after {n} records")
            yield record
    return gen


def hang_first_attempt(marker_dir: str, partition: int, after: int) -> Any:
    """RDD mapPartitionsWithIndex: partition ``partition``'s first attempt, after
    yielding ``after`` records (so the feeding task in the same Python worker
    has sent some chunks), writes its pid to ``pid-<partition>`` and hangs until
    the test SIGKILLs it: a feeding task killed mid-partition, which sends no
    failure notice."""
    def gen(index: int, records: Any) -> Any:
        from pyspark import TaskContext

        first = TaskContext.get().attemptNumber() == 0
        for n, record in enumerate(records):
            if first and index == partition and n == after:
                path = os.path.join(marker_dir, f"pid-{index}")
                with open(path + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(path + ".tmp", path)
                time.sleep(600)
            yield record
    return gen


def epoch_checkpoints(args: Dict[str, Any], ctx: Any) -> None:
    """Trains epoch by epoch, one step (``args["step"]`` s) per batch, and
    checkpoints after a step whenever ``feed.epochs_done`` grew (the file
    ``ckpt-<index>`` holds it); a restarted node resumes from its checkpoint
    (``ctx.resume_from``).  After every step, ``counts-<index>-<restart>.json``
    holds how many records of each epoch this run trained (by ``feed.epoch``)."""
    out, me = args["out"], ctx.worker_num
    restart = int(os.environ.get("EMBER_RESTART", "0"))
    ckpt = os.path.join(out, f"ckpt-{me}")
    start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
    ctx.resume_from(start)
    feed = ctx.get_data_feed()
    counts: Dict[int, int] = {}
    labels = []  # the epoch of each batch, in order

    def save(path: str, text: str) -> None:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

    saved = start
    while not feed.should_stop():
        batch = feed.next_batch(args.get("batch", 50))
        if len(batch) == 0:
            break
        time.sleep(args.get("step", 0))  # the training step
        counts[feed.epoch] = counts.get(feed.epoch, 0) + len(batch)
        if not labels or labels[-1] != feed.epoch:
            labels.append(feed.epoch)
        save(os.path.join(out, f"counts-{me}-{restart}.json"),
             json.dumps(dict(pid=os.getpid(), start=start, counts=counts, labels=labels)))
        done = feed.epochs_done
        if done is not None and done > saved:
            saved = done
            save(ckpt, str(done))


def epoch_counts(path: str) -> Dict[Tuple[int, int], Any]:
    """(node, restart) -> what nodefuns.epoch_checkpoints wrote."""
    runs = {}
    for name in os.listdir(path):
        if name.startswith("counts-") and name.endswith(".json"):
            node, restart = name[len("counts-"):-len(".json")].split("-")
            with open(os.path.join(path, name)) as f:
                info = json.load(f)
            info["counts"] = {int(k): v for k, v in info["counts"].items()}
            runs[int(node), int(restart)] = info
    return runs


def kill_mid_epoch(path: str, holder: Dict[str, Any], epoch: int, at: int) -> None:
    """SIGKILLs node 1 once it has trained ``at`` records of ``epoch`` and both
    nodes' checkpoints say ``epoch`` epochs are done."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        run0 = epoch_counts(path).get((1, 0))
        try:
            ckpts = [int(open(os.path.join(path, f"ckpt-{i}")).read()) for i in (0, 1)]
        except (OSError, ValueError):
            ckpts = []
        if run0 and run0["counts"].get(epoch, 0) >= at and ckpts and ckpts[1] == epoch \
                and ckpts[0] >= epoch:
            holder["counts"] = run0["counts"]
            os.kill(run0["pid"], signal.SIGKILL)
            return
        time.sleep(0.02)


def stamp_at_end(path: str) -> Any:
    """RDD mapPartitionsWithIndex: partition 1 writes the time its last record
    was taken (right before the feeding task converts its final chunk)."""
    def gen(index: int, records: Any) -> Any:
        yield from records
        if index == 1:
            with open(path, "w") as f:
                f.write(repr(time.time()))
    return gen


def crash_in_partition(path: str, partition: int, at: int) -> Any:
    """RDD mapPartitionsWithIndex: partition ``partition`` writes the time to
    ``path`` and ends its Python worker (os._exit) at record ``at``, as a
    segfaulting library or the OOM killer would."""
    def gen(index: int, records: Any) -> Any:
        for i, rec in enumerate(records):
            if index == partition and i == at:
                with open(path, "w") as f:
                    f.write(repr(time.time()))
                os._exit(1)
            yield rec
    return gen


def lockstep(args: Dict[str, Any], ctx: Any) -> None:
    """Consumes in lockstep, as a synchronous strategy does (MultiWorkerMirroredStrategy
    all-reduces every step): every step all-reduces "I have a batch" over the fed
    nodes, and a node that has one waits in that all-reduce for the others.  Stops
    when no node has a batch; records which ids arrived in which epoch."""
    import numpy as np

    feed = ctx.get_data_feed()
    ids, epochs, steps = [], [], 0
    while True:
        batch = feed.next_batch(args.get("batch", 10)) if not feed.should_stop() else []
        have = np.array([1.0 if len(batch) else 0.0])
        ctx.allreduce(have, "sum", timeout=args.get("step_timeout", 600.0))
        if have[0] == 0:
            break
        steps += 1
        if len(batch):
            ids.extend(int(i) for i in batch.columns[0])
            epochs.extend([feed.epoch] * len(batch))
    _write(args, ctx, ids=ids, epochs=epochs, steps=steps, errors=feed.producer_errors)


def count_calls(args: Dict[str, Any], ctx: Any) -> None:
    """Reads ``args["expect"]`` records spread over many train() calls; counts the
    records, their sum, the non-empty batches and how many of them ended with
    the feed saying this node's share of the call had ended (``should_stop``):
    a batch never spans two calls, so with one record per node per call every
    batch should be one call's whole share."""
    feed = ctx.get_data_feed()
    total = value_sum = batches = ends = 0
    while total < args["expect"]:
        batch = feed.next_batch(64)
        if not len(batch):
            time.sleep(0.0005)  # between calls: the next call's data is on its way
            continue
        total += len(batch)
        value_sum += int(sum(int(v) for v in batch.columns[0]))
        batches += 1
        ends += feed.should_stop()
    _write(args, ctx, total=total, value_sum=value_sum, batches=batches, ends=ends)


def synthetic_points(n: int) -> Any:
    """n points of 8 features and a label that depends on two of them."""
    import numpy as np

    x = np.random.default_rng(7).normal(size=(n, 8)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int64)


def keras_fit_on_feed_dataset(args: Dict[str, Any], ctx: Any) -> None:
    """Keras 3 ``model.fit`` straight on the node's feed through Ember's
    TensorFlow op (ember.tf.feed_dataset): a DataFrame's columns x (array of
    floats) and y (label) arrive as tensors, every epoch of the train() call
    in one pass.  Reports the accuracy on the whole data set and the rows the
    node trained on."""
    import keras

    from ember import tf as ember_tf

    ds = ember_tf.feed_dataset(ctx, 32, as_dict=True)
    try:
        ctx.get_data_feed()
        refused = ""
    except RuntimeError as exc:  # one reader per feed
        refused = str(exc)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(ds.map(lambda b: (b["x"], b["y"])), epochs=1, verbose=0)
    x, y = synthetic_points(args["n"])
    _, accuracy = model.evaluate(x, y, verbose=0)
    _write(args, ctx, rows=ds._ember_feed_reader.stats()["rows"], accuracy=float(accuracy),
           refused=refused)


def report_fork(args: Dict[str, Any], ctx: Any) -> None:
    """What a node forked by a fork server (ember._forkserver) starts with:
    whether TensorFlow was imported before main_fun ran, its parent, its
    session, environment, directory and a draw of numpy's global generator;
    then a TensorFlow op.  Raises on node ``args["bad"]``."""
    import sys

    preloaded = "tensorflow" in sys.modules
    import numpy as np
    import tensorflow as tf

    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().replace(b"\0", b" ").decode()
    if ctx.worker_num == args.get("bad"):
        raise ValueError(f"boom from forked node {ctx.worker_num}")
    _write(args, ctx, preloaded=preloaded, parent=parent, ppid=os.getppid(),
           session_leader=os.getsid(0) == os.getpid(), job_env=os.environ.get("EMBER_TEST_JOB"),
           cwd=os.getcwd(), path=sys.path, main=sys.modules["__main__"].__name__,
           draw=int(np.random.randint(1 << 30)), total=float(tf.reduce_sum(tf.ones([3]))))
