"""Helpers of test_ml_torch.py that Spark's Python workers and Ember's nodes
import by name (the train_fn of a saved Estimator must be importable)."""

# (no "from __future__ import annotations": TorchScript reads Classifier's
# annotations)
import argparse
import os
from typing import Any, Dict

import torch


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
