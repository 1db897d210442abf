"""What runs inside the sides of make bench-train (bench/train.py): the peers'
training functions, as their users write them, and the limit.

Every side trains the main job's model (784-256-128-10, Adam 1e-3; the torch
sides the same layers in PyTorch) on the same rows, the same epochs and
batch per process, and writes ``<out>/<side>.json`` from its rank 0: the
time of every step boundary it needs (the end of the first epoch's steps
and of the last step) and the steps it took, so that the driver computes
the steady-state rate the same way for every side.  Models are saved where
the driver evaluates them, outside every clock.

    python bench/train_nodes.py limit <epochs> <global batch> <threads> <out dir>
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _write(out: str, side: str, info: Dict[str, Any]) -> None:
    path = os.path.join(out, f"{side}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def _train_arrays(limit: int = 0) -> Any:
    sys.path.insert(0, REPO)
    from examples.fashion_mnist.data import load_split

    images, labels = load_split("train")
    if limit:
        images, labels = images[:limit], labels[:limit]
    return (images.reshape(len(images), -1).astype(np.float32) / 255.0,
            labels.astype(np.int64))


class _StepClock:
    """Wall-clock times of the step boundaries: the first one at or after
    step ``first`` (the first epoch's steps) and the last one."""

    def __init__(self, first: int) -> None:
        self.first, self.steps = first, 0
        self.t_first = self.t_last = None  # type: Any
        self.n_first = 0  # the step count at t_first

    def step(self, n: int = 1) -> None:
        self.steps += n
        now = time.time()
        if self.t_first is None and self.steps >= self.first:
            self.t_first, self.n_first = now, self.steps
        self.t_last = now

    def info(self) -> Dict[str, Any]:
        return dict(first=self.n_first, steps=self.steps, t_first=self.t_first, t_last=self.t_last)


def _keras_clock(keras: Any, clock: _StepClock) -> Any:
    class Clock(keras.callbacks.Callback):
        # with steps_per_execution Keras calls back once an execution, with
        # the index of its last step in the epoch
        done = 0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.done = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            clock.step(batch + 1 - self.done)
            self.done = batch + 1
    return Clock()


# --------------------------------------------------------------------------- the limit

def limit(epochs: int, batch: int, threads: int, out: str, records: int) -> None:
    """The same model in one process from in-memory arrays, at the global
    batch, on ``threads`` threads: what the cores compute with no feed and
    no collective."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    import tf_keras as keras

    sys.path.insert(0, REPO)
    from examples.fashion_mnist.model import (STEPS_PER_CALL, build_model, export_saved_model,
                                              make_optimizer)

    x, y = _train_arrays(records)
    model = build_model()
    # as many steps per call as Ember's trainer takes (Keras's own way to
    # spare the per-call dispatch)
    model.compile(optimizer=make_optimizer(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=STEPS_PER_CALL)
    clock = _StepClock(len(x) // batch)
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=True,
              callbacks=[_keras_clock(keras, clock)])
    export_saved_model(tf, model, os.path.join(out, "limit-export"))
    _write(out, "limit", clock.info())


# --------------------------------------------------------------------------- TensorFlowOnSpark

def tfos_main(args: Any, ctx: Any) -> None:
    """TensorFlowOnSpark 2.2.5's Keras program in InputMode.SPARK, in its best
    configuration: MultiWorkerMirroredStrategy (TF's collective ring), the
    feed read a batch at a time (next_batch(batch), not TFoS's example's
    record at a time) into from_generator, model.fit for the steps the data
    holds; the chief exports the model."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras
    from tensorflowonspark import TFNode

    sys.path.insert(0, REPO)
    from examples.fashion_mnist.model import (STEPS_PER_CALL, build_model, export_saved_model,
                                              make_optimizer)

    tf.config.threading.set_intra_op_parallelism_threads(args["threads"])
    tf.config.threading.set_inter_op_parallelism_threads(args["threads"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    feed = TFNode.DataFeed(ctx.mgr, False)
    batch = args["batch"]

    def batches() -> Any:
        while not feed.should_stop():
            rows = feed.next_batch(batch)
            if not rows:
                return
            yield (np.stack([r[0] for r in rows]).astype(np.float32),
                   np.array([r[1] for r in rows], np.int64))

    ds = tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec([None, 784], tf.float32), tf.TensorSpec([None], tf.int64)))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = ds.with_options(options).prefetch(tf.data.AUTOTUNE)
    with strategy.scope():
        model = build_model()
        # the same optimizer and steps per call as the limit's and Ember's
        model.compile(optimizer=make_optimizer(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=STEPS_PER_CALL)
    steps = args["records"] // (batch * ctx.num_workers)
    clock = _StepClock(steps)
    model.fit(ds, epochs=args["epochs"], steps_per_epoch=steps, verbose=0,
              callbacks=[_keras_clock(keras, clock)])
    chief = ctx.job_name == "chief"
    # every worker takes part in the save (MWMS); the others to a scratch dir
    export = os.path.join(args["out"], "tfos-export" if chief else f"tfos-export-{ctx.task_index}")
    export_saved_model(tf, model, export)
    if chief:
        _write(args["out"], "tfos", clock.info())
    feed.terminate()


# --------------------------------------------------------------------------- PyTorch

def _torch_model() -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def _torch_train(batches: Any, net: Any, opt: Any, clock: _StepClock, agree: Any) -> None:
    """The training loop of both torch sides; ``agree(have)`` tells whether
    every rank has a batch for the next step (ranks may hold uneven data)."""
    import torch

    loss_fn = torch.nn.CrossEntropyLoss()
    net.train()
    for x, y in batches:
        if not agree(True):
            break
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
        clock.step()
    else:
        agree(False)


def torchdistributor_main(parquet: str, args: Dict[str, Any]) -> None:
    """TorchDistributor's training function, as its users write it: DDP over
    gloo, each process reading its share of the DataFrame's Parquet files
    (pyarrow) into tensors, a DataLoader of shuffled batches."""
    import pyarrow.dataset as pads
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    files = sorted(pads.dataset(parquet, format="parquet").files)[rank::size]
    table = pads.dataset(files, format="parquet").to_table()
    images = table.column("image").combine_chunks()  # list<float>, 784 per row
    x = torch.from_numpy(images.flatten().to_numpy().reshape(len(images), 784)
                         .astype(np.float32))
    y = torch.from_numpy(table.column("label").to_numpy().astype(np.int64))
    torch.manual_seed(1)
    model = _torch_model()
    net = DistributedDataParallel(model)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=args["batch"], shuffle=True)
    clock = _StepClock(args["records"] // (args["batch"] * size))
    flag = torch.zeros(1)

    def agree(have: bool) -> bool:
        flag[0] = 1.0 if have else 0.0
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag[0] > 0)

    def epochs() -> Any:
        for _ in range(args["epochs"]):
            yield from loader
    _torch_train(epochs(), net, opt, clock, agree)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args["out"], "torchdistributor.pt"))
        _write(args["out"], "torchdistributor", clock.info())
    dist.destroy_process_group()


def ember_torch_main(args: Dict[str, Any], ctx: Any) -> None:
    """Ember's PyTorch path: the feed as an IterableDataset of batches that
    share its memory (ember.torch.FeedDataset), DDP with its gradient
    buckets summed on Ember's collective."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ember.torch

    torch.set_num_threads(args["threads"])
    ember.torch.init_process_group(ctx, timeout=600)
    torch.manual_seed(1)
    model = _torch_model()
    net = DistributedDataParallel(model)
    net.register_comm_hook(ctx.collective, ember.torch.allreduce_hook)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    clock = _StepClock(args["records"] // (args["batch"] * ctx.num_workers))
    have = np.zeros(1, np.int32)

    def agree(ok: bool) -> bool:
        have[0] = ok
        return bool(ctx.allreduce(have, "min")[0])

    loader = torch.utils.data.DataLoader(ember.torch.FeedDataset(ctx, args["batch"]),
                                         batch_size=None)
    _torch_train(iter(loader), net, opt, clock, agree)
    feed = ctx.get_data_feed(train_mode=True)
    while not feed.should_stop() and len(feed.next_batch(4096)):
        pass  # a rank with more rows than the others drains its feed
    if ctx.collective.rank == 0:
        torch.save(model.state_dict(), os.path.join(args["out"], "ember_torch.pt"))
        _write(args["out"], "ember_torch", clock.info())
    ctx.barrier()
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "limit":
        limit(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
              int(sys.argv[6]) if len(sys.argv) > 6 else 0)
    else:
        raise SystemExit(f"unknown side {sys.argv[1]!r}")
