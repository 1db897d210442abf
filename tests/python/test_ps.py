"""Tests of the parameter server's binding (ember._ember.PsServer, PsClient):
shards and workers run in this process on loopback, and each optimizer's
result is checked against numpy implementations of Keras's update rules.
"""
import contextlib
import os
import threading
import time

import numpy as np
import pytest

from ember import _ember as E

HOST = "127.0.0.1"


def start_shards(stack, secret, num_shards, num_workers, **kwargs):
    return [stack.enter_context(E.PsServer(secret, k, num_shards, num_workers, host=HOST,
                                           **kwargs))
            for k in range(num_shards)]


def connect(stack, servers, secret, worker, num_workers, **kwargs):
    return stack.enter_context(E.PsClient([HOST] * len(servers), [s.port for s in servers],
                                          secret, worker, num_workers, **kwargs))


@contextlib.contextmanager
def cluster(num_shards=2, num_workers=1, **server_kwargs):
    """(secret, servers, stack): shards on loopback, closed on exit with
    every client connected through stack."""
    secret = os.urandom(32)
    with contextlib.ExitStack() as stack:
        yield secret, start_shards(stack, secret, num_shards, num_workers, **server_kwargs), stack


def rows_held(servers):
    return [s.stats()["rows_held"] for s in servers]


def keras_adam(w, m, v, step, g, lr, beta1=0.9, beta2=0.999, epsilon=1e-7):
    """One step of keras.optimizers.Adam on one row (step counts from 1)."""
    alpha = lr * np.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
    m = m + (g - m) * (1.0 - beta1)
    v = v + (g * g - v) * (1.0 - beta2)
    return w - m * alpha / (np.sqrt(v) + epsilon), m, v


# ---------------------------------------------------------------- optimizers

def test_dense_sgd_round_trip_over_two_shards():
    lr = np.float32(0.25)
    with cluster(num_shards=2) as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0)
        client.declare("w", "dense", 7, 3, "sgd", lr, init="uniform", init_scale=0.5, seed=11)
        w = client.pull("w", None, 3)
        assert w.dtype == np.float32 and w.shape == (7, 3)
        assert np.all(np.abs(w) <= 0.5) and len(np.unique(w)) == w.size
        # the dense rows are split 3 + 4, all held from the declaration on
        assert rows_held(servers) == [3, 4]

        rng = np.random.default_rng(0)
        whole = rng.standard_normal((7, 3)).astype(np.float32)
        client.push("w", None, whole)
        expected = (w.astype(np.float64) - np.float64(lr) * whole).astype(np.float32)
        # a row named twice gets both gradients; rows span both shards
        ids = np.array([2, 2, 5], dtype=np.uint64)
        some = rng.standard_normal((3, 3)).astype(np.float32)
        client.push("w", ids, some)
        for i, row in enumerate(ids):
            expected[row] = (expected[row].astype(np.float64)
                             - np.float64(lr) * some[i]).astype(np.float32)

        np.testing.assert_allclose(client.pull("w", None, 3), expected, rtol=1e-6)
        np.testing.assert_allclose(client.pull("w", [6, 0, 3, 6], 3), expected[[6, 0, 3, 6]],
                                   rtol=1e-6)
        stats = [s.stats() for s in servers]
        assert sum(st["pushes"] for st in stats) == 4  # whole: both shards; ids: both
        assert all(st["tables"] == 1 and st["requests_refused"] == 0 for st in stats)
        sent, received = client.bytes()
        assert sent > 0 and received >= 2 * 7 * 3 * 4

    # a row's initial values depend on (seed, row, column) only: one shard
    # holding all seven rows starts them the same
    with cluster(num_shards=1) as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0)
        client.declare("w", "dense", 7, 3, "sgd", lr, init="uniform", init_scale=0.5, seed=11)
        np.testing.assert_array_equal(client.pull("w", None, 3), w)


def test_sparse_adam_over_two_shards_matches_keras():
    lr, cols = 0.01, 4
    rows = 10 ** 9  # sparse: only the rows touched exist
    with cluster(num_shards=2) as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0)
        client.declare("emb", "sparse", rows, cols, "adam", lr, init="normal", init_scale=0.1,
                       seed=3)
        # three rows on different shards, pushed 4, 2 and 1 times
        a, b, c = 7, 123456789, 999_999_999
        assert len({E.ps_shard_of_row("sparse", rows, r, 2) for r in (a, b, c)}) == 2
        w0 = client.pull("emb", np.array([a, b, c], dtype=np.int64), cols)
        assert sum(rows_held(servers)) == 3 and 0 not in rows_held(servers)
        assert np.std(w0) > 0.01

        state = {r: [w0[i].astype(np.float64), np.zeros(cols), np.zeros(cols), 0]
                 for i, r in enumerate((a, b, c))}
        rng = np.random.default_rng(1)
        # the third step names a twice: both gradients apply, in order
        for ids in ([a, b, c], [a, b], [a, a]):
            grads = rng.standard_normal((len(ids), cols)).astype(np.float32)
            client.push("emb", np.array(ids, dtype=np.uint64), grads)
            for row, g in zip(ids, grads):
                w, m, v, step = state[row]
                w, m, v = keras_adam(w, m, v, step + 1, g.astype(np.float64), lr)
                state[row] = [w, m, v, step + 1]

        got = client.pull("emb", [c, a, b], cols)
        want = np.stack([state[r][0] for r in (c, a, b)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        assert sum(rows_held(servers)) == 3

        with pytest.raises(E.EmberError, match="sparse"):
            client.pull("emb", None, cols)  # a sparse table has no "whole"
        with pytest.raises(E.EmberError, match="out of range"):
            client.pull("emb", [rows], cols)


# ---------------------------------------------------------------- buffers and errors

def test_pull_into_preallocated_out_fills_it_in_place():
    with cluster() as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0)
        client.declare("t", "dense", 5, 4, "sgd", 0.1, init="uniform", init_scale=1.0, seed=5)
        want = client.pull("t", None, 4)

        out = np.zeros((3, 4), dtype=np.float32)
        assert client.pull("t", [4, 1, 0], 4, out=out) is out
        np.testing.assert_array_equal(out, want[[4, 1, 0]])
        flat = np.zeros(20, dtype=np.float32)  # any shape of the right size
        assert client.pull("t", None, 4, flat) is flat
        np.testing.assert_array_equal(flat.reshape(5, 4), want)

        with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
            client.pull("t", [0, 1], 4, out=np.zeros((2, 5), dtype=np.float32))
        with pytest.raises(ValueError, match="float32"):
            client.pull("t", [0, 1], 4, out=np.zeros((2, 4), dtype=np.float64))
        with pytest.raises(TypeError, match="writable"):
            client.pull("t", [0], 4, out=bytes(16))
        empty = client.pull("t", np.array([], dtype=np.uint64), 4)
        assert empty.shape == (0, 4)


def test_row_ids_are_checked():
    with cluster() as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0)
        client.declare("t", "dense", 5, 2, "sgd", 0.1)
        with pytest.raises(ValueError, match=r"ids\[1\] is -3"):
            client.pull("t", np.array([1, -3], dtype=np.int64), 2)
        with pytest.raises(ValueError, match="negative"):
            client.push("t", [0, -1], np.zeros((2, 2), dtype=np.float32))
        with pytest.raises(TypeError, match="8-byte integers"):
            client.pull("t", np.array([1, 2], dtype=np.int32), 2)
        with pytest.raises(TypeError):
            client.pull("t", "01", 2)
        with pytest.raises(TypeError, match="float32"):
            client.push("t", [0], np.zeros((1, 2), dtype=np.float64))
        # strided ids are not C-contiguous
        with pytest.raises(TypeError, match="C-contiguous"):
            client.pull("t", np.arange(4, dtype=np.uint64)[::2], 2)
        np.testing.assert_array_equal(client.pull("t", np.arange(4, dtype=np.uint64)[::2].copy(),
                                                  2), np.zeros((2, 2)))


def test_wrong_shape_push_raises_schema_error_naming_both_shapes():
    with cluster() as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0)
        client.declare("weights", "dense", 6, 4, "sgd", 0.1, init="uniform", init_scale=1.0)
        before = client.pull("weights", None, 4)

        with pytest.raises(E.EmberSchemaError) as err:
            client.push("weights", [1, 2], np.ones((2, 5), dtype=np.float32))
        assert isinstance(err.value, ValueError) and err.value.name == "EMBER_ESCHEMA"
        message = str(err.value)
        assert "'weights'" in message and "(2, 5)" in message and "(2, 4)" in message
        assert "(6, 4)" in message  # and the table's

        with pytest.raises(E.EmberSchemaError, match=r"\(7,\).*\(2, 4\)"):
            client.push("weights", [1, 2], np.ones(7, dtype=np.float32))
        with pytest.raises(E.EmberSchemaError, match=r"'weights'.*\(5, 4\).*\(6, 4\)"):
            client.push("weights", None, np.ones((5, 4), dtype=np.float32))
        # libember's own check, on a pull of rows of another width
        with pytest.raises(E.EmberSchemaError, match=r"'weights'.*3 floats.*\(6, 4\)"):
            client.pull("weights", [0], 3)

        # nothing was applied, and the client is still usable
        np.testing.assert_array_equal(client.pull("weights", None, 4), before)


def test_unknown_table_raises_naming_it():
    with cluster() as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0)
        client.declare("known", "dense", 2, 2, "sgd", 0.1)
        for call in (lambda: client.pull("missing", [0], 2),
                     lambda: client.pull("missing", None, 2),
                     lambda: client.push("missing", [0], np.zeros((1, 2), np.float32))):
            with pytest.raises(E.EmberError, match="'missing'") as err:
                call()
            assert err.value.name == "EMBER_ENOTFOUND"
        assert client.pull("known", None, 2).shape == (2, 2)


def test_declare_checks_its_arguments_and_the_spec():
    with cluster() as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0)
        with pytest.raises(ValueError, match="'dense' or 'sparse'"):
            client.declare("t", "diagonal", 2, 2, "sgd", 0.1)
        with pytest.raises(ValueError, match="'adagrad' or 'adam'"):
            client.declare("t", "dense", 2, 2, "rmsprop", 0.1)
        with pytest.raises(ValueError, match="init"):
            client.declare("t", "dense", 2, 2, "sgd", 0.1, init="ones")
        with pytest.raises(ValueError):
            client.declare("t", "dense", -1, 2, "sgd", 0.1)
        with pytest.raises(E.EmberError, match="cols"):
            client.declare("t", "dense", 2, 0, "sgd", 0.1)
        client.declare("t", "dense", 2, 2, "momentum", 0.1, momentum=0.9)
        client.declare("t", "dense", 2, 2, "momentum", 0.1, momentum=0.9)  # the same: a no-op
        with pytest.raises(E.EmberSchemaError, match="'t'"):
            client.declare("t", "dense", 2, 3, "momentum", 0.1, momentum=0.9)
        assert [s.stats()["tables"] for s in servers] == [1, 1]


def test_encrypted_connections():
    with cluster(encrypt=True) as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0, encrypt=True)
        client.declare("t", "dense", 3, 2, "adagrad", 0.5, initial_accumulator=0.1)
        client.push("t", None, np.ones((3, 2), dtype=np.float32))
        # Keras 3's Adagrad: epsilon (1e-7) inside the root
        want = 0.0 - 0.5 * 1.0 / np.sqrt(0.1 + 1.0 + 1e-7)
        np.testing.assert_allclose(client.pull("t", None, 2), np.full((3, 2), want), rtol=1e-6)


# ---------------------------------------------------------------- transport

def test_same_host_client_uses_shared_memory_and_matches_tcp():
    with cluster(num_shards=2, num_workers=2) as (secret, servers, stack):
        shm = connect(stack, servers, secret, 0, 2, timeout_s=10.0, shm_bytes=64 * 1024)
        tcp = connect(stack, servers, secret, 1, 2, timeout_s=10.0, shm=False)
        assert shm.transports == ["shm", "shm"]
        assert tcp.transports == ["tcp", "tcp"]
        assert [s.stats()["shm_connections"] for s in servers] == [1, 1]
        assert [s.stats()["workers_connected"] for s in servers] == [2, 2]
        for c in (shm, tcp):
            c.declare("w", "dense", 4000, 50, "sgd", 0.5, init="uniform", init_scale=1.0, seed=3)
            c.declare("e", "sparse", 10 ** 9, 16, "adam", 0.01, init="normal", init_scale=0.1,
                      seed=4)
        # 800 KB each way: many records of the 64 KiB rings
        w = shm.pull("w", None, 50)
        np.testing.assert_array_equal(w, tcp.pull("w", None, 50))
        g = np.random.default_rng(1).standard_normal((4000, 50)).astype(np.float32)
        shm.push("w", None, g)
        expected = (w.astype(np.float64) - 0.5 * g).astype(np.float32)
        np.testing.assert_allclose(tcp.pull("w", None, 50), expected, rtol=1e-6)
        ids = np.array([7, 10 ** 8, 123456789, 7], dtype=np.uint64)
        before = [shm.bytes(), tcp.bytes()]
        rows = shm.pull("e", ids, 16)
        np.testing.assert_array_equal(rows, tcp.pull("e", ids, 16))
        after = [shm.bytes(), tcp.bytes()]
        # the same payload bytes whichever the transport
        assert [a - b for a, b in zip(after[0], before[0])] == \
            [a - b for a, b in zip(after[1], before[1])]
        assert sum(shm.bytes(k)[1] for k in range(2)) == shm.bytes()[1]
        with pytest.raises(ValueError, match="shard"):
            shm.bytes(2)


def test_encrypted_or_refused_clients_stay_on_tcp():
    with cluster(num_shards=2, encrypt=True) as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0, encrypt=True)
        assert client.transports == ["tcp", "tcp"]
        with pytest.raises(E.EmberError, match="encrypt"):
            connect(stack, servers, secret, 0, 1, timeout_s=10.0, encrypt=True, shm=True)
    with cluster(num_shards=1, shm=False) as (secret, servers, stack):
        assert connect(stack, servers, secret, 0, 1, timeout_s=10.0).transports == ["tcp"]
        with pytest.raises(E.EmberError, match="declined.*disabled"):
            connect(stack, servers, secret, 0, 1, timeout_s=10.0, shm=True)
        with pytest.raises(E.EmberError, match="shm_bytes"):
            connect(stack, servers, secret, 0, 1, timeout_s=10.0, shm_bytes=1000)


# ---------------------------------------------------------------- bounded staleness

def test_bounded_staleness_timeout_names_the_slow_worker():
    with cluster(num_workers=2, staleness=1) as (secret, servers, stack):
        leader = connect(stack, servers, secret, 0, 2, timeout_s=0.5)
        slow = connect(stack, servers, secret, 1, 2, timeout_s=5.0)
        for client in (leader, slow):
            client.declare("t", "dense", 4, 2, "sgd", 0.1)
        leader.clock()
        leader.pull("t", None, 2)  # one step ahead: within the bound
        leader.clock()
        start = time.monotonic()
        with pytest.raises(E.EmberTimeout) as err:
            leader.pull("t", [0, 3], 2)
        elapsed = time.monotonic() - start
        assert isinstance(err.value, TimeoutError)
        assert "worker 1" in str(err.value)
        assert 0.4 <= elapsed < 4.0

        # a refused pull leaves the client usable: once the slow worker
        # clocks, the leader is within the bound again
        slow.clock()
        assert leader.pull("t", [0, 3], 2).shape == (2, 2)
        assert sum(s.stats()["stale_waits"] for s in servers) >= 1


def test_staleness_wait_releases_the_gil_for_the_slow_worker():
    with cluster(num_workers=2, staleness=1) as (secret, servers, stack):
        leader = connect(stack, servers, secret, 0, 2, timeout_s=5.0)
        slow = connect(stack, servers, secret, 1, 2, timeout_s=5.0)
        for client in (leader, slow):
            client.declare("t", "dense", 4, 2, "sgd", 0.1)
        leader.clock()
        leader.clock()

        clocking_at = []
        ticks = []

        def clock_slow_worker():
            # runs only while the leader's pull waits without the GIL
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:
                ticks.append(1)
                time.sleep(0.01)
            # before the call: the leader's pull may return before it does
            clocking_at.append(time.monotonic())
            slow.clock()

        thread = threading.Thread(target=clock_slow_worker, daemon=True)
        start = time.monotonic()
        thread.start()
        rows = leader.pull("t", None, 2)
        returned_at = time.monotonic()
        thread.join(5.0)
        assert not thread.is_alive()
        assert rows.shape == (4, 2)
        assert clocking_at and start + 0.25 <= clocking_at[0] <= returned_at
        assert returned_at - start < 4.0  # released by the clock, not by the timeout
        assert len(ticks) > 5
        assert sum(s.stats()["stale_waits"] for s in servers) >= 1

        slow.finish()  # a finished worker holds nobody back
        for _ in range(3):
            leader.clock()
        leader.pull("t", [1], 2)
        assert min(s.stats()["min_clock"] for s in servers) == 5


def test_close_from_another_thread_aborts_a_waiting_pull():
    with cluster(num_workers=2, staleness=0) as (secret, servers, stack):
        leader = connect(stack, servers, secret, 0, 2, timeout_s=60.0)
        leader.declare("t", "dense", 4, 2, "sgd", 0.1)
        leader.clock()  # worker 1 never comes: the pull waits
        raised = []

        def pull():
            try:
                leader.pull("t", None, 2)
            except Exception as e:  # noqa: BLE001 - the test inspects it
                raised.append(e)

        thread = threading.Thread(target=pull, daemon=True)
        thread.start()
        time.sleep(0.3)
        start = time.monotonic()
        leader.close()
        thread.join(5.0)
        assert not thread.is_alive() and time.monotonic() - start < 2.0
        assert raised and isinstance(raised[0], E.EmberAborted), raised


# ---------------------------------------------------------------- checkpoints

def test_checkpoint_save_then_restore_on_new_servers(tmp_path):
    def declare(client):
        client.declare("dense", "dense", 5, 3, "momentum", 0.1, momentum=0.9, init="uniform",
                       init_scale=1.0, seed=2)
        client.declare("emb", "sparse", 1000, 2, "adam", 0.05, init="normal", init_scale=0.5,
                       seed=9)

    rng = np.random.default_rng(7)
    ids = np.array([3, 999, 42, 500], dtype=np.uint64)
    dense_grads = rng.standard_normal((5, 3)).astype(np.float32)
    emb_grads = rng.standard_normal((4, 2)).astype(np.float32)
    with cluster(num_shards=2) as (secret, servers, stack):
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0)
        declare(client)
        client.push("dense", None, dense_grads)
        client.push("emb", ids, emb_grads)
        client.save(tmp_path)
        assert sorted(os.listdir(tmp_path)) == ["ps-0-of-2.ckpt", "ps-1-of-2.ckpt"]
        servers[0].save(str(tmp_path / "again"))  # a server saves on its own too
        assert os.listdir(tmp_path / "again") == ["ps-0-of-2.ckpt"]

        # the same step again on the live servers: the restored ones must
        # agree, optimizer state (velocity, Adam's moments and steps) included
        client.push("dense", None, dense_grads)
        client.push("emb", ids, emb_grads)
        want_dense = client.pull("dense", None, 3)
        want_emb = client.pull("emb", ids, 2)

    with cluster(num_shards=2) as (secret, servers, stack):
        for server in servers:
            server.restore(tmp_path)
        assert [s.stats()["tables"] for s in servers] == [2, 2]
        client = connect(stack, servers, secret, 0, 1, timeout_s=10.0)
        declare(client)  # the same specs: a no-op
        client.push("dense", None, dense_grads)
        client.push("emb", ids, emb_grads)
        np.testing.assert_array_equal(client.pull("dense", None, 3), want_dense)
        np.testing.assert_array_equal(client.pull("emb", ids, 2), want_emb)
        with pytest.raises(E.EmberError) as err:
            servers[0].restore(tmp_path)  # tables exist now
        assert err.value.name == "EMBER_ESTATE"

    with cluster(num_shards=3) as (secret, servers, stack):
        with pytest.raises(E.EmberError):
            servers[0].restore(tmp_path)  # no ps-0-of-3.ckpt there


# ---------------------------------------------------------------- lifetime

def test_close_is_idempotent_and_closed_objects_raise():
    secret = os.urandom(32)
    server = E.PsServer(secret, 0, 1, 1, host=HOST)
    client = E.PsClient([HOST], [server.port], secret, 0, 1, timeout_s=10.0)
    assert (client.worker, client.num_workers, client.num_shards) == (0, 1, 1)
    client.declare("t", "dense", 2, 2, "sgd", 0.1)
    client.close()
    client.close()
    for call in (lambda: client.pull("t", None, 2), lambda: client.clock(),
                 lambda: client.push("t", None, np.zeros((2, 2), np.float32)),
                 lambda: client.bytes(), lambda: client.finish(),
                 lambda: client.declare("u", "dense", 2, 2, "sgd", 0.1)):
        with pytest.raises(ValueError, match="PsClient is closed"):
            call()
    server.close()
    server.close()
    with pytest.raises(ValueError, match="PsServer is closed"):
        server.stats()
    with pytest.raises(ValueError, match="PsServer is closed"):
        server.port  # noqa: B018 - the property raises

    with E.PsServer(secret, 0, 1, 1, host=HOST) as server:
        with E.PsClient([HOST], [server.port], secret, 0, 1, timeout_s=10.0) as client:
            client.declare("t", "dense", 2, 2, "sgd", 0.1)
        with pytest.raises(ValueError):
            client.clock()
    with pytest.raises(ValueError):
        server.stats()


def test_constructor_arguments_are_checked():
    secret = os.urandom(32)
    with pytest.raises(E.EmberError, match="shard 2 of 2"):
        E.PsServer(secret, 2, 2, 1, host=HOST)
    with pytest.raises(E.EmberError, match="secret"):
        E.PsServer(b"short", 0, 1, 1, host=HOST)
    with pytest.raises(ValueError):
        E.PsServer(secret, 0, 1, 1, staleness=-1)
    assert E.PS_ASYNC == 2 ** 32 - 1
    with E.PsServer(secret, 0, 1, 1, host=HOST, staleness=E.PS_ASYNC) as server:
        with pytest.raises(ValueError, match="same 1..1024 shards"):
            E.PsClient([HOST, HOST], [server.port], secret, 0, 1)
        with pytest.raises(TypeError):
            E.PsClient(HOST, [server.port], secret, 0, 1)
        with pytest.raises(ValueError, match="timeout_s"):
            E.PsClient([HOST], [server.port], secret, 0, 1, timeout_s=0)
        with pytest.raises(E.EmberError, match="worker 1 of 1"):
            E.PsClient([HOST], [server.port], secret, 1, 1, timeout_s=5.0)
        # the shard counts 1 worker: a client of a 2-worker job is refused
        with pytest.raises(E.EmberError, match="serves 1 workers"):
            E.PsClient([HOST], [server.port], secret, 0, 2, timeout_s=5.0)
        with pytest.raises(E.EmberAuthError):
            E.PsClient([HOST], [server.port], os.urandom(32), 0, 1, timeout_s=5.0)
