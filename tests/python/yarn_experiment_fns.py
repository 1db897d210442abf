"""experiment_fn bodies for ember.yarn.experiment tests (Fashion-MNIST), usable
both through ``ember.spark.run`` (tests/python/test_yarn_experiment_local.py)
and ``ember.yarn.run_on_yarn``: bind the arguments with ``functools.partial``.

``run_experiment(args, ctx)`` is the Spark main_fun: it calls
``ember.yarn.experiment.run_task`` exactly as a YARN container's
``ember.yarn.task`` does, and writes the returned dict to
``<args["out"]>/<job>-<index>.json``.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Dict


def run_experiment(args: Dict[str, Any], ctx: Any) -> None:
    from ember.yarn.experiment import run_task

    result = run_task(args["experiment_fn"], ctx)
    path = os.path.join(args["out"], f"{ctx.job_name}-{ctx.task_index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def _images(split: str) -> Any:
    import numpy as np

    from examples.fashion_mnist.data import load_split

    x, y = load_split(split)
    return x.reshape(len(x), -1).astype(np.float32) / 255.0, y.astype(np.int64)


# ---------------------------------------------------------------- Keras

def keras_fmnist(model_dir: str, epochs: int = 4, batch_size: int = 64,
                 learning_rate: float = 3e-3) -> Any:
    """A 784-128-10 MLP on the full Fashion-MNIST training set (each rank
    trains on its shard), evaluated on the 10,000 test images."""
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    from ember.yarn.experiment import KerasExperiment

    # a different initial model on every task: only Ember's broadcast of the
    # chief's weights (or its checkpoint) makes the replicas agree
    keras.utils.set_random_seed(1000 + int(os.environ.get("RANK", "99")))
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    train = functools.lru_cache(None)(lambda: _images("train"))
    return KerasExperiment(
        model=model, model_dir=model_dir,
        train_params={"epochs": epochs, "batch_size": batch_size, "shuffle": True},
        input_data_fn=lambda: train()[0], target_data_fn=lambda: train()[1],
        validation_data_fn=lambda: _images("test"))


def keras_tiny(model_dir: str, epochs: int = 2) -> Any:
    """A small synthetic problem (which side of a line), for model_dir tests."""
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras

    from ember.yarn.experiment import KerasExperiment

    x, y = _line_data()
    return KerasExperiment(_line_model(keras), model_dir, {"epochs": epochs, "batch_size": 64},
                           lambda: x[:1536], lambda: y[:1536], lambda: (x[1536:], y[1536:]))


def _line_data(rows: int = 2048) -> Any:
    """(x, y): 8 normal floats per row, label 1 where x0 + x1 > 0."""
    import numpy as np

    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int64)


def _line_model(keras: Any) -> Any:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def line_records(url: str, rows: int = 2048) -> None:
    """Writes the "which side of a line" problem (8 floats, a label) as
    TFRecords of Examples to url (local or hdfs://)."""
    from ember import tfrecord

    x, y = _line_data(rows)
    tfrecord.write(url, {"x": x, "y": y})


def _read_line_records(url: str) -> Any:
    import numpy as np

    from ember import tfrecord

    batches = list(tfrecord.reader(url, 4096, {"x": ("float32", (8,)), "y": "int64"}))
    return (np.concatenate([b["x"] for b in batches]), np.concatenate([b["y"] for b in batches]))


def keras_line_records(data_url: str, model_dir: str, epochs: int = 2) -> Any:
    """keras_tiny's problem read from TFRecords (line_records), e.g. on HDFS."""
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras

    from ember.yarn.experiment import KerasExperiment

    data = functools.lru_cache(None)(lambda: _read_line_records(data_url))
    return KerasExperiment(_line_model(keras), model_dir, {"epochs": epochs, "batch_size": 64},
                           lambda: data()[0][:1536], lambda: data()[1][:1536],
                           lambda: (data()[0][1536:], data()[1][1536:]))


# ---------------------------------------------------------------- PyTorch

def _torch_mlp() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def _torch_main(model: Any, trainloader: Any, device: str, rank: int, tb_writer: Any,
                epochs: int, learning_rate: float) -> Dict[str, Any]:
    """main_fn: ``epochs`` passes over this rank's shard, then the accuracy
    of the trained model on the 10,000 test images."""
    import hashlib

    import torch

    opt = torch.optim.Adam(model.parameters(), lr=learning_rate)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    steps = 0
    for epoch in range(epochs):
        if hasattr(trainloader.sampler, "set_epoch"):
            trainloader.sampler.set_epoch(epoch)
        total, n = 0.0, 0
        model.train()
        for x, y in trainloader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total += float(loss)
            n += 1
        steps += n
        losses.append(total / max(n, 1))
        if tb_writer is not None:
            tb_writer.add_scalar("loss", losses[-1], epoch)
    test_x, test_y = _images("test")
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(test_x).to(device)).argmax(1).cpu().numpy()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return {"accuracy": float((pred == test_y).mean()), "loss": losses, "steps": steps,
            "params_sha256": digest.hexdigest()}


def torch_fmnist(epochs: int = 3, batch_size: int = 64, learning_rate: float = 2e-3,
                 rows: int = 0, n_workers_per_executor: int = 1) -> Any:
    """DDP on the Fashion-MNIST training set (``rows`` > 0: its first rows)."""
    import torch

    from ember.yarn.experiment import DataLoaderArgs, PytorchExperiment

    torch.set_num_threads(1)
    torch.manual_seed(1000 + int(os.environ.get("RANK", "99")))  # DDP broadcasts rank 0's
    x, y = _images("train")
    if rows:
        x, y = x[:rows], y[:rows]
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return PytorchExperiment(
        model=_torch_mlp(),
        main_fn=functools.partial(_torch_main, epochs=epochs, learning_rate=learning_rate),
        train_dataset=dataset,
        dataloader_args=DataLoaderArgs(batch_size=batch_size, shuffle=True, drop_last=True),
        n_workers_per_executor=n_workers_per_executor)


def _torch_line_main(model: Any, trainloader: Any, device: str, rank: int, tb_writer: Any,
                     data_url: str, epochs: int) -> Dict[str, Any]:
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(epochs):
        trainloader.sampler.set_epoch(epoch)
        for x, y in trainloader:
            opt.zero_grad()
            loss_fn(model(x.to(device)), y.to(device)).backward()
            opt.step()
    x, y = _read_line_records(data_url)
    with torch.no_grad():
        pred = model(torch.from_numpy(x[1536:]).to(device)).argmax(1).cpu().numpy()
    return {"accuracy": float((pred == y[1536:]).mean())}


def torch_line_records(data_url: str, epochs: int = 3) -> Any:
    """keras_line_records for PyTorch: the TFRecords (e.g. on HDFS) read with
    Ember's C reader into a TensorDataset."""
    import torch

    from ember.yarn.experiment import DataLoaderArgs, PytorchExperiment

    torch.manual_seed(3)
    x, y = _read_line_records(data_url)
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x[:1536]),
                                             torch.from_numpy(y[:1536]))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return PytorchExperiment(
        model=model,
        main_fn=functools.partial(_torch_line_main, data_url=data_url, epochs=epochs),
        train_dataset=dataset, dataloader_args=DataLoaderArgs(batch_size=64, shuffle=True))
