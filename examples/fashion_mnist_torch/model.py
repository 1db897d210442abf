"""The node functions of the PyTorch example (main_fun(args, ctx) of ember.spark.run).

Training is data-parallel on every chief/worker node, with one of three
strategies (``args.strategy``); all start from rank 0's initial weights and
keep the replicas identical; rank 0 saves the model.

- ``ddp``: torch's DistributedDataParallel as is, its process group (gloo) set
  up from the cluster spec by ``ember.torch.init_process_group``;
- ``ddp-ember``: the same, with DDP's gradient buckets averaged on Ember's
  collective (``ember.torch.allreduce_hook``);
- ``ember``: no torch.distributed: ``ember.torch.broadcast_parameters`` and
  ``ember.torch.DistributedOptimizer`` (gradients averaged before each step).
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator, Optional, Tuple

import numpy as np

NUM_PIXELS = 28 * 28


def _torch(args: Any) -> Any:
    import torch

    torch.set_num_threads(max(1, int(getattr(args, "threads", 1) or 1)))
    return torch


def build_model() -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Linear(NUM_PIXELS, 256), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def _report(ctx: Any, text: str) -> None:
    ctx.report_progress(text)  # the driver prints it with the node's name


def _feed_batches(ctx: Any, batch_size: int) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """InputMode.SPARK: (images float32 (n, 784), labels int64 (n,)) from the feed."""
    feed = ctx.get_data_feed(train_mode=True)
    while not feed.should_stop():
        batch = feed.next_batch(batch_size)
        if len(batch) == 0:
            continue
        x, y = batch.columns  # views of the feed's memory: copied for torch
        yield (np.array(np.stack(x) if x.dtype == object else x, np.float32),
               np.array(y, np.int64))


def _file_batches(args: Any, rank: int, size: int,
                  batch_size: int) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """InputMode.TENSORFLOW: this rank reads its own shard of the idx files."""
    from examples.fashion_mnist.data import load_split

    images, labels = load_split("train")
    if args.train_limit:
        images, labels = images[:args.train_limit], labels[:args.train_limit]
    x = images[rank::size].reshape(-1, NUM_PIXELS).astype(np.float32) / 255.0
    y = labels[rank::size].astype(np.int64)
    rng = np.random.default_rng(args.seed + rank)
    for _ in range(args.epochs):
        order = rng.permutation(len(y))
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            yield x[idx], y[idx]


def train(args: Any, ctx: Any) -> None:
    """Trains in either input mode with ``args.strategy``.

    Ranks may hold different amounts of data (Spark partitions fall unevenly),
    so before each step the ranks agree, with one tiny allreduce (min), whether
    every one of them has a next batch; all stop at the same step and what is
    left in a feed is drained."""
    if ctx.job_name not in ("chief", "worker"):
        return
    torch = _torch(args)
    import ember.torch

    rank, size = ctx.collective.rank, ctx.collective.size
    torch.manual_seed(args.seed + rank)  # different initial weights: the broadcast fixes that
    model = build_model()
    strategy = getattr(args, "strategy", "ddp")
    if strategy == "ember":
        ember.torch.broadcast_parameters(model, ctx)
        net = model
        opt = ember.torch.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=args.learning_rate), ctx)
    elif strategy in ("ddp", "ddp-ember"):
        from torch.nn.parallel import DistributedDataParallel

        ember.torch.init_process_group(ctx, timeout=600)
        net = DistributedDataParallel(model)  # broadcasts rank 0's parameters
        if strategy == "ddp-ember":
            net.register_comm_hook(ctx.collective, ember.torch.allreduce_hook)
        opt = torch.optim.Adam(net.parameters(), lr=args.learning_rate)
    else:
        raise ValueError(f"unknown strategy {strategy!r} (ddp, ddp-ember or ember)")
    loss_fn = torch.nn.CrossEntropyLoss()
    if args.input_mode == "spark":
        batches = _feed_batches(ctx, args.batch_size)
    else:
        batches = _file_batches(args, rank, size, args.batch_size)
    have = np.zeros(1, np.int32)
    steps = records = 0
    start = time.monotonic()
    net.train()
    while True:
        batch: Optional[Tuple[np.ndarray, np.ndarray]] = next(batches, None)
        have[0] = batch is not None
        if ctx.allreduce(have, "min")[0] == 0:
            break
        x, y = batch  # type: ignore[misc]
        opt.zero_grad()
        loss = loss_fn(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        steps += 1
        records += len(y)
        if steps % 200 == 0:
            _report(ctx, f"rank {rank}: step {steps} loss {loss.item():.4f}")
    left = sum(len(b[1]) for b in batches) if args.input_mode == "spark" else 0
    digest = np.frombuffer(_weights_bytes(model), np.uint8).astype(np.int64).sum()
    sums = ctx.allgather(np.array([digest], np.int64))
    if len(set(sums[:, 0].tolist())) != 1:
        raise RuntimeError(f"rank {rank}: replicas diverged (weight checksums {sums[:, 0]})")
    _report(ctx, f"rank {rank} ({strategy}): {steps} steps, {records} records in "
                 f"{time.monotonic() - start:.1f} s ({left} left over); replicas identical")
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.out_dir, "model.pt.tmp"))
        os.replace(os.path.join(args.out_dir, "model.pt.tmp"),
                   os.path.join(args.out_dir, "model.pt"))
    ctx.barrier()  # the model is saved before any node reports done
    if strategy != "ember":
        import torch.distributed as dist

        dist.destroy_process_group()


def _weights_bytes(model: Any) -> bytes:
    return b"".join(p.detach().numpy().tobytes() for p in model.state_dict().values())


def infer(args: Any, ctx: Any) -> None:
    """Inference main_fun: one [label, predicted class] (int64) per fed record."""
    torch = _torch(args)
    model = build_model()
    model.load_state_dict(torch.load(os.path.join(args.out_dir, "model.pt")))
    model.eval()
    feed = ctx.get_data_feed(train_mode=False)
    count = 0
    while not feed.should_stop():
        batch = feed.next_batch(1024)
        if len(batch) == 0:
            continue
        x, y = batch.columns
        x = np.array(np.stack(x) if x.dtype == object else x, np.float32)
        with torch.no_grad():
            pred = model(torch.from_numpy(x)).argmax(dim=1).numpy().astype(np.int64)
        feed.batch_results(np.stack([np.asarray(y, np.int64), pred], axis=1))
        count += len(batch)
    _report(ctx, f"{ctx.job_name}:{ctx.task_index} inferred {count} records")
