"""The PyTorch path: ember.torch and the Fashion-MNIST PyTorch example on Spark.

Runs in .venv-torch (``make test-torch``), where Debian's CPU-only torch
imports; the main venv (numpy 2, no torch) skips this file.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch runs in .venv-torch: make test-torch")

import torchfuns  # noqa: E402
from conftest import read_json_files  # noqa: E402
from ember.spark import InputMode, run  # noqa: E402


def test_ddp_gloo_ember_hook_and_optimizer_agree(local_spark, tmp_path):
    sc = local_spark.sparkContext
    cluster = run(sc, torchfuns.ddp_paths, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.TENSORFLOW, reservation_timeout=120)
    cluster.shutdown(timeout=300)
    a, b = sorted(read_json_files(str(tmp_path)), key=lambda i: i["rank"])
    assert (a["rank"], b["rank"], a["world"]) == (0, 1, 2)
    assert (a["coll_rank"], b["coll_rank"]) == (0, 1)  # Ember's ranks are torch's ranks
    for key in ("gloo", "hook", "ember_opt"):
        assert a[key] == b[key], key  # replicas identical on each path
    # the three paths compute the same training (up to float rounding)
    np.testing.assert_allclose(a["hook"], a["gloo"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a["ember_opt"], a["gloo"], rtol=1e-5, atol=1e-6)
    assert a["opt_class"] == "SGD"
    assert (a["bn_tracked"], b["bn_tracked"]) == (7, 7)  # rank 0's 0-d buffer
    assert "before attaching an LR scheduler" in a["scheduler_error"]


def test_fashion_mnist_torch_example_both_input_modes(local_spark, tmp_path):
    from examples.fashion_mnist_torch import main

    # DDP with its gradient buckets on Ember's collective (test above: the same
    # training as DDP over gloo and as ember.torch.DistributedOptimizer)
    results = main.main(["--epochs", "3", "--strategy", "ddp-ember", "--work-dir",
                         str(tmp_path)], sc=local_spark.sparkContext)
    assert [r[0] for r in results] == ["spark", "tensorflow"]
    for mode, accuracy, _ in results:
        assert accuracy >= 0.85, (mode, accuracy)
