"""The PyTorch path: ember.torch and the Fashion-MNIST PyTorch example on Spark.

PyPI's torch (requirements.txt), in the same venv as TensorFlow.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (requirements.txt pins it)")

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


def test_feed_dataset_batches_share_the_feed_memory_and_train():
    """ember.torch.FeedDataset over a real feed server that a feeding client
    fills over TCP: batches in order, numeric fields as tensors viewing the
    received rows, one pass per feed call, and a model trains on them."""
    import threading

    from ember import _columns, _ember
    from ember.node import DataFeed
    from ember.torch import FeedDataset

    secret = b"t" * 32
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1024, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)

    def feed(server, call, lo, hi):
        with _ember.FeedClient("127.0.0.1", server.port, secret, 0, timeout_s=30.0, call=call,
                               call_partitions=1) as c:
            for a in range(lo, hi, 256):
                rows = [(x[i], int(y[i]), f"r{i}") for i in range(a, min(a + 256, hi))]
                specs, n = _columns.records_to_columns(rows)
                c.send(specs, n, 30.0)
            c.end_partition(30.0)

    with _ember.FeedServer(secret, host="127.0.0.1") as server:
        t = threading.Thread(target=feed, args=(server, 1, 0, 1024))
        t.start()
        data = DataFeed(server)
        dataset = FeedDataset(data, 64)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        seen, losses = [], []
        loader = torch.utils.data.DataLoader(dataset, batch_size=None)
        for i, (xb, yb, names) in enumerate(loader):
            if i == 0:  # the first batch views the first received chunk
                item = np.frombuffer(data._chunk.item, np.uint8)
                lo = item.ctypes.data
                assert lo <= xb.data_ptr() < lo + item.size
            assert xb.dtype == torch.float32 and xb.shape == (len(yb), 4)
            seen.extend(names)
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        t.join(30)
        assert seen == [f"r{i}" for i in range(1024)]  # every row once, in order
        assert losses[-1] < losses[0]
        # a pass that starts once the next feed call's rows came reads that call
        before = server.stats()["batches_received"]
        t = threading.Thread(target=feed, args=(server, 2, 0, 100))
        t.start()
        while server.stats()["batches_received"] == before:
            threading.Event().wait(0.01)
        batches = list(FeedDataset(data, 64, as_dict=True))
        t.join(30)
        assert [len(b["1"]) for b in batches] == [64, 36]
        assert torch.equal(batches[1]["0"], torch.from_numpy(x[64:100]))
