"""PyTorch on Ember's parameter servers: ember.torch.ParameterServerOptimizer
and ember.torch.PsEmbedding.

In process first: two shards on loopback (ember._ember.PsServer, as in
test_ps.py) and a fake ``ctx`` whose ``parameter_servers()`` is an
ember.ps.Client, against torch.optim and numpy versions of the servers'
update rules; then on Spark (``run(..., num_ps=2, parameter_servers=...)``
on the shared local session, like test_ps_spark.py for Keras).
"""

from __future__ import annotations

import contextlib
import copy
import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (requirements.txt pins it)")

import ember.torch  # noqa: E402
import psfuns  # noqa: E402
import torch_psfuns  # noqa: E402
from ember import _ember as E  # noqa: E402
from ember.ps import Client  # noqa: E402

HOST = "127.0.0.1"


class FakeCtx:
    """What ParameterServerOptimizer and PsEmbedding use of a node's ctx."""

    def __init__(self, client):
        self._client = client
        self.collective = types.SimpleNamespace(barrier=lambda: None)

    def parameter_servers(self):
        return self._client


@contextlib.contextmanager
def shards(num_shards=2, num_workers=1):
    """(servers, connect(worker) -> FakeCtx), closed on exit."""
    secret = os.urandom(32)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(E.PsServer(secret, k, num_shards, num_workers, host=HOST))
                   for k in range(num_shards)]

        def connect(worker=0):
            raw = stack.enter_context(E.PsClient([HOST] * num_shards,
                                                 [s.port for s in servers], secret, worker,
                                                 num_workers, timeout_s=10.0))
            return FakeCtx(Client(raw))

        yield servers, connect


def regression(seed=0, steps=8):
    """A linear model, an unused parameter (never gets a .grad) and batches."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Linear(3, 2))
    model.unused = torch.nn.Parameter(torch.randn(4, 2, 2))
    gen = torch.Generator().manual_seed(seed + 1)
    true_w = torch.randn(6, 2, generator=gen)
    batches = []
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen)
        batches.append((x, x @ true_w + 0.1 * torch.randn(16, 2, generator=gen)))
    return model, batches


def train(model, opt, batches):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


# ---------------------------------------------------------------- ParameterServerOptimizer

@pytest.mark.parametrize("how", ["sgd", "sgd instance with momentum"])
def test_sgd_matches_torch_sgd(how):
    model, batches = regression()
    local = copy.deepcopy(model)
    if how == "sgd":
        ref = torch.optim.SGD(local.parameters(), lr=0.05)
        given = "sgd"
    else:
        ref = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
        given = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with shards() as (servers, connect):
        opt = ember.torch.ParameterServerOptimizer(model, connect(), given, 0.05,
                                                   prefix="reg")
        assert opt.spec["optimizer"] == ("sgd" if how == "sgd" else "momentum")
        # named_parameters order: the module's own parameter first
        assert opt.tables == ["reg/unused", "reg/0.weight", "reg/0.bias", "reg/1.weight",
                              "reg/1.bias"]
        unused = model.unused.detach().clone()
        got = train(model, opt, batches)
        want = train(local, ref, batches)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        np.testing.assert_allclose(flat(model), flat(local), rtol=1e-5, atol=1e-6)
        assert got[-1] < got[0]
        # the parameter without a gradient got zeros: unchanged, as torch leaves it
        assert torch.equal(model.unused, unused)
        assert sum(s.stats()["tables"] for s in servers) == 2 * 5
        assert opt.steps == len(batches)


def server_adam(w, m, v, step, g, lr, beta1, beta2, epsilon):
    """The servers' Adam on one row (csrc/ps_table.c apply: Keras's, step from 1)."""
    alpha = lr * np.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
    m = m + (g - m) * (1.0 - beta1)
    v = v + (g * g - v) * (1.0 - beta2)
    return w - m * alpha / (np.sqrt(v) + epsilon), m, v


def test_adam_is_the_servers_formula_and_close_to_torch_adam():
    """The servers' Adam (Keras's) puts epsilon outside the bias correction:
    exact against a numpy version of it, and within float noise of
    torch.optim.Adam when epsilon is far below the gradients."""
    lr, eps = 0.01, 1e-8
    model, batches = regression(seed=3)
    numpy_model, torch_model = copy.deepcopy(model), copy.deepcopy(model)
    with shards() as (_, connect):
        opt = ember.torch.ParameterServerOptimizer(
            model, connect(), torch.optim.Adam(model.parameters(), lr=lr, eps=eps))
        assert opt.spec == dict(optimizer="adam", learning_rate=lr, beta1=0.9, beta2=0.999,
                                epsilon=eps)
        train(model, opt, batches)

    state = {id(p): (np.zeros(p.shape), np.zeros(p.shape)) for p in numpy_model.parameters()}
    for step, (x, y) in enumerate(batches, 1):
        numpy_model.zero_grad()
        torch.nn.functional.mse_loss(numpy_model(x), y).backward()
        with torch.no_grad():
            for p in numpy_model.parameters():
                g = p.grad.double().numpy() if p.grad is not None else np.zeros(p.shape)
                m, v = state[id(p)]
                w, m, v = server_adam(p.double().numpy(), m, v, step, g, lr, 0.9, 0.999, eps)
                state[id(p)] = (m, v)
                p.copy_(torch.from_numpy(w))
    np.testing.assert_allclose(flat(model), flat(numpy_model), rtol=1e-5, atol=1e-6)

    train(torch_model, torch.optim.Adam(torch_model.parameters(), lr=lr, eps=eps), batches)
    # (torch's Adam skips the unused parameter; the servers get zeros, and
    # with m = 0 leave it unchanged too)
    np.testing.assert_allclose(flat(model), flat(torch_model), rtol=1e-4, atol=1e-6)


def test_workers_start_from_the_chiefs_weights_in_any_dtype():
    with shards(num_workers=2) as (_, connect):
        chief, _ = regression(seed=1)
        ember.torch.ParameterServerOptimizer(chief, connect(0), "adagrad", 0.1)
        worker, batches = regression(seed=2)
        worker = worker.double()  # travels as float32, stays float64
        assert not np.allclose(flat(worker), flat(chief))
        opt = ember.torch.ParameterServerOptimizer(worker, connect(1), "adagrad", 0.1)
        assert all(p.dtype == torch.float64 for p in worker.parameters())
        np.testing.assert_array_equal(flat(worker), flat(chief).astype(np.float64))
        losses = train(worker, opt, [(x.double(), y.double()) for x, y in batches])
        assert losses[-1] < losses[0]
        assert all(p.dtype == torch.float64 for p in worker.parameters())


def test_unsupported_optimizers_are_refused_naming_what():
    model, _ = regression()
    ctx = FakeCtx(None)  # refused before the servers are asked anything
    cases = [
        (torch.optim.Adam(model.parameters(), weight_decay=0.01, amsgrad=True),
         r"Adam\(weight_decay=0.01, amsgrad=True\)"),
        (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
         r"nesterov=True"),
        (torch.optim.Adagrad(model.parameters(), maximize=True), r"maximize=True"),
        (torch.optim.SGD([{"params": model[0].parameters()},
                          {"params": model[1].parameters(), "lr": 0.01}], lr=0.1),
         "2 param groups"),
        (torch.optim.RMSprop(model.parameters()), "not RMSprop"),
    ]
    for given, match in cases:
        with pytest.raises(ValueError, match=match):
            ember.torch.ParameterServerOptimizer(model, ctx, given)
    with pytest.raises(ValueError, match="not 'lamb'"):
        ember.torch.ParameterServerOptimizer(model, ctx, "lamb")


# ---------------------------------------------------------------- PsEmbedding

def test_ps_embedding_pulls_the_rows_and_pushes_summed_gradients_of_touched_rows():
    lr, dim, rows = 0.5, 4, 10 ** 9
    with shards() as (servers, connect):
        ctx = connect()
        emb = ember.torch.PsEmbedding(rows, dim, ctx, optimizer="sgd", learning_rate=lr,
                                      init_scale=0.1, seed=7, name="items")
        assert list(emb.parameters()) == [] and emb.state_dict() == {}
        ids = torch.tensor([[3, 123456789], [3, 999_999_999]])
        out = emb(ids)
        assert out.shape == (2, 2, dim) and out.dtype == torch.float32 and out.requires_grad
        client = ctx.parameter_servers()
        w0 = client.pull(emb.table, [3, 123456789, 999_999_999], dim)
        np.testing.assert_array_equal(out.detach().numpy(), w0[[[0, 1], [0, 2]]])
        assert np.std(w0) > 0.01
        # only the three rows named exist on the servers
        assert sum(s.stats()["rows_held"] for s in servers) == 3

        coef = torch.randn(2, 2, dim, generator=torch.Generator().manual_seed(0))
        (out * coef).sum().backward()
        stats = [s.stats() for s in servers]
        # one push per shard that holds a row, one row per distinct id
        assert sum(st["rows_pushed"] for st in stats) == 3
        assert sum(st["rows_held"] for st in stats) == 3
        grads = np.stack([coef[0, 0] + coef[1, 0], coef[0, 1], coef[1, 1]]).astype(np.float32)
        np.testing.assert_allclose(client.pull(emb.table, [3, 123456789, 999_999_999], dim),
                                   w0 - lr * grads, rtol=1e-6, atol=1e-7)

        # no_grad: a lookup, nothing to push; int32 ids; an empty batch
        with torch.no_grad():
            again = emb(torch.tensor([999_999_999, 3], dtype=torch.int32))
        assert not again.requires_grad
        np.testing.assert_allclose(again.numpy(), (w0 - lr * grads)[[2, 0]], rtol=1e-6)
        assert emb(torch.zeros((0, 3), dtype=torch.int64)).shape == (0, 3, dim)
        assert sum(s.stats()["rows_pushed"] for s in servers) == 3

        with pytest.raises(IndexError, match="id -1 is not in"):
            emb(torch.tensor([5, -1]))
        with pytest.raises(IndexError, match=f"id {rows} is not in"):
            emb(torch.tensor([rows]))
        with pytest.raises(TypeError, match="integers"):
            emb(torch.tensor([1.0]))
        # a second embedding under the same name would share the table
        with pytest.raises(ValueError, match="'items/embeddings' is already trained"):
            ember.torch.PsEmbedding(rows, dim, ctx, optimizer="sgd", name="items")


def test_ps_embedding_in_a_model_trained_by_the_optimizer():
    with shards() as (_, connect):
        ctx = connect()
        torch.manual_seed(0)
        model = torch.nn.Sequential(ember.torch.PsEmbedding(1000, 4, ctx, learning_rate=0.3),
                                    torch.nn.Flatten(), torch.nn.Linear(4, 1))
        opt = ember.torch.ParameterServerOptimizer(model, ctx, "sgd", 0.1, prefix="clicks")
        assert opt.tables == ["clicks/2.weight", "clicks/2.bias"]
        ids = torch.arange(0, 1000, 7).reshape(-1, 1)
        labels = (ids % 2 == 0).float()
        for _ in range(30):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids), labels)
            loss.backward()
            opt.step()
        with torch.no_grad():
            accuracy = float(((model(ids) > 0).float() == labels).float().mean())
        assert accuracy > 0.95, accuracy


# ---------------------------------------------------------------- on Spark

def test_torch_trains_asynchronously_on_two_ps_shards(local_spark, tmp_path):
    # the same checks as the Keras test's (ParameterServerOptimizer.finish
    # leaves both with the servers' final weights); items of 8 floats
    psfuns.train_async_on_two_shards(local_spark.sparkContext, torch_psfuns.torch_async,
                                     str(tmp_path), 8)
