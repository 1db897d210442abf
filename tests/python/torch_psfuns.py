"""Node functions of the PyTorch parameter-server test (test_torch_ps.py): they
run in the nodes of an ``ember.spark.run(..., parameter_servers=...)`` cluster
and write what they saw to
``<out>/<role>-<task>.json``."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List

import numpy as np


def _write(args: Dict[str, Any], ctx: Any, info: Dict[str, Any]) -> None:
    path = os.path.join(args["out"], f"{ctx.job_name}-{ctx.task_index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict(info, role=ctx.job_name, task=ctx.task_index, pid=os.getpid()), f)
    os.replace(path + ".tmp", path)


def torch_async(args: Dict[str, Any], ctx: Any) -> None:
    """A Fashion-MNIST MLP trained asynchronously with Adam on the parameter
    servers (each worker its own shard of the data), then a click model whose
    1,000,000-row embedding table lives on them row-sparse; writes the
    accuracies and the bytes the click model moved."""
    import torch

    import ember.torch
    from examples.fashion_mnist.data import load_split

    torch.set_num_threads(1)
    ps = ctx.parameter_servers(timeout=120)
    rank, size = ps.worker, ps.num_workers
    n = args["n"]
    images, labels = load_split("train")
    x = torch.from_numpy(images[:n].reshape(n, -1).astype(np.float32) / 255.0)
    y = torch.from_numpy(labels[:n].astype(np.int64))
    x, y = x[rank::size], y[rank::size]
    torch.manual_seed(100 + rank)  # different starts: the chief's must win
    model = torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = ember.torch.ParameterServerOptimizer(model, ctx, "adam", 2e-3, prefix="mlp")
    # every worker starts from the chief's weights: the optimizer waits
    # until all have pulled them before anyone pushes
    start = [float(p.detach().sum()) for p in model.parameters()]
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(rank)
    losses: List[float] = []
    for _ in range(args["epochs"]):
        order = torch.randperm(len(x), generator=gen)
        total, batches = 0.0, 0
        for i in range(0, len(x), 64):
            idx = order[i:i + 64]
            opt.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total, batches = total + float(loss), batches + 1
        losses.append(total / batches)
    opt.finish()  # every worker ends with the servers' weights
    final = [float(p.detach().sum()) for p in model.parameters()]
    test_x, test_y = load_split("test")
    with torch.no_grad():
        logits = model(torch.from_numpy(test_x[:2000].reshape(2000, -1).astype(np.float32)
                                        / 255.0))
    accuracy = float((logits.argmax(1).numpy() == test_y[:2000]).mean())

    # clicks: the label is whether the item id is even; only a sparse
    # embedding of the id can learn it
    rows, dim, steps, batch = 1_000_000, 8, 60, 128
    rng = np.random.default_rng(rank)
    items = torch.from_numpy(rng.integers(0, 2000, size=steps * batch) * 499)  # over 1M
    clicks = (items % 2 == 0).float()
    clicker = torch.nn.Sequential(ember.torch.PsEmbedding(rows, dim, ctx, learning_rate=0.3,
                                                          name="items"),
                                  torch.nn.Flatten(), torch.nn.Linear(dim, 1))
    clicks_opt = ember.torch.ParameterServerOptimizer(clicker, ctx, "sgd", 0.1,
                                                      prefix="clicks")
    before = ps.bytes()
    epochs, right = 3, 0
    for epoch in range(epochs):
        for i in range(0, len(items), batch):
            ids, target = items[i:i + batch].reshape(-1, 1), clicks[i:i + batch].reshape(-1, 1)
            clicks_opt.zero_grad()
            logit = clicker(ids)
            torch.nn.functional.binary_cross_entropy_with_logits(logit, target).backward()
            clicks_opt.step()
            if epoch == epochs - 1:  # the last epoch's accuracy, as Keras's History has it
                right += int(((logit.detach() > 0).float() == target).sum())
    after = ps.bytes()
    clicks_opt.finish()
    _write(args, ctx, dict(
        rank=rank, size=size, shards=ps.num_shards, start=start, final=final, loss=losses,
        accuracy=accuracy, clicks_accuracy=right / len(items),
        clicks_received=after[1] - before[1], clicks_sent=after[0] - before[0],
        clicks_steps=epochs * steps, distinct_items=int(len(np.unique(items.numpy()))),
        table_bytes=rows * dim * 4, at=time.time()))
