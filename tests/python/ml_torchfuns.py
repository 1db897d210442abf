"""Helpers of test_ml_torch.py that Spark's Python workers and Ember's nodes
import by name (the train_fn of a saved Estimator must be importable)."""

# (no "from __future__ import annotations": TorchScript reads Classifier's
# annotations)
import argparse
import os
from typing import Any, Dict

import numpy as np

try:
    import torch
except ImportError:  # the main venv: only the data helpers are used there
    torch = None


def _expand(batches: Any) -> Any:
    """mapInArrow: rows of whole chunks (images bytes, labels bytes, first id) -> one
    row per image: id long, pixels array<float> (0..255), label long."""
    import pyarrow as pa

    for b in batches:
        for imgs, lbls, first in zip(b.column(0).to_pylist(), b.column(1).to_pylist(),
                                     b.column(2).to_pylist()):
            x = np.frombuffer(imgs, dtype=np.uint8).astype(np.float32)
            y = np.frombuffer(lbls, dtype=np.int64)
            offsets = pa.array(np.arange(0, x.size + 1, 784, dtype=np.int32))
            yield pa.RecordBatch.from_arrays(
                [pa.array(np.arange(first, first + y.size, dtype=np.int64)),
                 pa.ListArray.from_arrays(offsets, pa.array(x)), pa.array(y)],
                names=["id", "pixels", "label"])


def fashion_frame(spark: Any, split: str, limit: int = 0, parts: int = 4) -> Any:
    """Fashion-MNIST as a DataFrame: id long, pixels array<float> (raw 0..255), label long."""
    from examples.fashion_mnist import data

    images, labels = data.load_split(split)
    if limit:
        images, labels = images[:limit], labels[:limit]
    images = images.reshape(-1, 784)
    bounds = np.linspace(0, len(labels), parts + 1).astype(int)
    chunks = [(images[a:b].tobytes(), labels[a:b].astype(np.int64).tobytes(), int(a))
              for a, b in zip(bounds[:-1], bounds[1:])]
    blobs = spark.createDataFrame(spark.sparkContext.parallelize(chunks, parts),
                                  "images binary, labels binary, first long")
    return blobs.mapInArrow(_expand, "id long, pixels array<float>, label long")


if torch is not None:
    class Classifier(torch.nn.Module):
        """A trained MLP with the serving outputs of the TF example's signature."""

        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, image: torch.Tensor) -> Dict[str, torch.Tensor]:
            logits = self.net(image)
            return {"logits": logits, "probabilities": torch.softmax(logits, dim=-1),
                    "classes": logits.argmax(dim=-1)}


def train_fn(args: Any, ctx: Any) -> None:
    """EmberEstimator train_fn: the PyTorch example's DDP training on the fed
    columns (image, label), then rank 0 exports a TorchScript classifier
    (image -> logits, probabilities, classes) to ExportDir."""
    from examples.fashion_mnist_torch import model as fmt

    import ember.ml

    values = dict(args) if isinstance(args, dict) else vars(args)
    run_args = argparse.Namespace(**values)
    run_args.input_mode = "spark"
    run_args.out_dir = values["model_dir"]  # the state dict, as the example saves it
    fmt.train(run_args, ctx)
    if ctx.job_name not in ("chief", "worker") or ctx.collective.rank != 0:
        return
    net = fmt.build_model()
    net.load_state_dict(torch.load(os.path.join(run_args.out_dir, "model.pt")))
    ember.ml.save_torchscript(Classifier(net).eval(), values["export_dir"],
                              example_inputs={"image": torch.zeros(1, 784)})
