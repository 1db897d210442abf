"""Tests of the CPython extension ember._ember on its own: no Spark, only the
extension, numpy, threads and raw sockets on loopback.

Nodes run as threads of this process, so every RendezvousClient here is
started with exit_on_loss=False: with it, losing the server would SIGKILL
this process group (pytest included).
"""
import hashlib
import hmac
import os
import random
import re
import socket
import struct
import threading
import time

import numpy as np
import pytest

import ember
from ember import _ember as E

HOST = "127.0.0.1"
MAGIC = b"EMBR"
WIRE_VERSION = 1
MSG_CHALLENGE, MSG_AUTH, MSG_AUTH_OK, MSG_REFUSED = 1, 2, 3, 4
MSG_REGISTER, MSG_SPEC, MSG_HEARTBEAT, MSG_REPORT, MSG_STOP = 16, 17, 18, 19, 20
MSG_FEED_HELLO, MSG_BATCH, MSG_END_PARTITION = 32, 33, 34


# ---------------------------------------------------------------- helpers

class Worker(threading.Thread):
    """A thread that keeps its target's result or exception for join_result()."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args = fn, args
        self.result = self.error = None

    def run(self):
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - re-raised in join_result
            self.error = e

    def join_result(self, timeout=30.0):
        self.join(timeout)
        assert not self.is_alive(), "worker thread hung"
        if self.error is not None:
            raise self.error
        return self.result


def drain_events(srv, until=None, timeout=10.0):
    """Collects events until one of kind `until` (or a quiet timeout)."""
    events = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = srv.next_event(0.2)
        if ev is None:
            if until is None:
                break
            continue
        events.append(ev)
        if ev[0] == until:
            break
    return events


def register_node(port, secret, index, ports=(), start=True):
    c = E.RendezvousClient(HOST, port, secret, 10.0)
    c.register(index, HOST, f"exec-{index}", os.getpid(), list(ports), 10.0)
    nodes, pos = c.wait_spec(10.0)
    if start:
        c.start(interval_ms=200, exit_on_loss=False)
    return c, nodes, pos


def run_reservation(srv, secret, n):
    workers = [Worker(register_node, srv.port, secret, i, (20000 + i, 30000 + i))
               for i in range(n)]
    for w in workers:
        w.start()
    srv.wait_ready(20.0)
    return [w.join_result() for w in workers]


def frame(mtype, payload=b"", length=None, magic=MAGIC, version=WIRE_VERSION):
    if length is None:
        length = len(payload)
    return magic + struct.pack("<HHI", version, mtype, length) + payload


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def recv_frame(sock):
    hdr = recv_exact(sock, 12)
    assert hdr[:4] == MAGIC
    _, mtype, length = struct.unpack("<HHI", hdr[4:])
    return mtype, recv_exact(sock, length)


def raw_authenticate(sock, secret):
    """Runs the client side of the handshake in Python (auth.h)."""
    mtype, sn = recv_frame(sock)
    assert mtype == MSG_CHALLENGE and len(sn) == 32
    cn = os.urandom(32)
    mac = hmac.new(secret, b"ember-auth-v1 client" + sn + cn, hashlib.sha256).digest()
    sock.sendall(frame(MSG_AUTH, cn + mac))
    mtype, proof = recv_frame(sock)
    assert mtype == MSG_AUTH_OK
    assert proof == hmac.new(secret, b"ember-auth-v1 server" + cn + sn,
                             hashlib.sha256).digest()


def bytes_column(name, values):
    """(name, DT_BYTES, 0, data, offsets) for a list of bytes."""
    lens = np.fromiter((len(v) for v in values), dtype=np.uint64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.uint64)
    np.cumsum(lens, out=offsets[1:])
    return (name, E.DT_BYTES, 0, b"".join(values), offsets)


def column_array(item, col, dtype):
    """A zero-copy numpy view of a fixed-width column of a FeedItem."""
    name, dt, width, off, nbytes, ooff = col
    assert ooff == -1
    count = nbytes // np.dtype(dtype).itemsize
    arr = np.frombuffer(item, dtype=dtype, count=count, offset=off)
    return arr.reshape(item.nrows, width) if width > 1 else arr


def column_strings(item, col):
    name, dt, width, off, nbytes, ooff = col
    assert dt == E.DT_BYTES and ooff >= 0
    offs = np.frombuffer(item, dtype=np.uint64, count=item.nrows + 1, offset=ooff)
    data = bytes(memoryview(item)[off:off + nbytes])
    return [data[offs[i]:offs[i + 1]] for i in range(item.nrows)]


# ---------------------------------------------------------------- module

def test_module_constants():
    assert E.__version__ == ember.__version__
    assert (E.DT_F32, E.DT_F64, E.DT_I32, E.DT_I64, E.DT_U8, E.DT_BYTES, E.DT_BOOL) == (
        1, 2, 3, 4, 5, 6, 7)
    assert issubclass(E.EmberTimeout, E.EmberError)
    assert issubclass(E.EmberTimeout, TimeoutError)
    assert issubclass(E.EmberAuthError, E.EmberError)
    assert issubclass(E.EmberAborted, E.EmberError)
    with pytest.raises(TypeError):
        E.FeedItem()


def test_random_secret_and_reserve_port():
    a, b = E.random_secret(), E.random_secret()
    assert isinstance(a, bytes) and len(a) == 32 and a != b

    fd, port = E.reserve_port(HOST)
    try:
        assert 0 < port < 65536
        # Bound but not listening: nobody can connect, yet the port is ours.
        with pytest.raises(OSError):
            socket.create_connection((HOST, port), timeout=1.0).close()
    finally:
        os.close(fd)

    fd, port = E.reserve_port(HOST, listen=True, backlog=4)
    try:
        socket.create_connection((HOST, port), timeout=1.0).close()
    finally:
        os.close(fd)


def test_bad_timeouts_rejected():
    srv = E.RendezvousServer(E.random_secret(), 1, host=HOST)
    try:
        for bad in (-1.0, float("nan")):
            with pytest.raises(ValueError):
                srv.wait_ready(bad)
        with pytest.raises(TypeError):
            srv.next_event("soon")
        assert srv.next_event(0) is None
    finally:
        srv.close()


# ---------------------------------------------------------------- rendezvous

def test_reservation_two_nodes():
    secret = E.random_secret()
    srv = E.RendezvousServer(secret, 2, host=HOST)
    try:
        results = run_reservation(srv, secret, 2)
        events = drain_events(srv, until="ready")
        kinds = [e[0] for e in events]
        assert kinds.count("registered") == 2 and kinds[-1] == "ready"
        assert sorted(e[1] for e in events if e[0] == "registered") == [0, 1]

        table = srv.nodes()
        assert [n["index"] for n in table] == [0, 1]
        assert [n["role"] for n in table] == ["worker", "worker"]
        assert [n["task_index"] for n in table] == [0, 1]
        for i, n in enumerate(table):
            assert n["host"] == HOST
            assert n["executor_id"] == f"exec-{i}"
            assert n["pid"] == os.getpid()
            assert n["ports"] == [20000 + i, 30000 + i]

        for i, (client, nodes, pos) in enumerate(results):
            assert pos == i
            assert list(nodes) == nodes.tolist() == table  # a ClusterSpec: rows decoded on access
            assert len(nodes) == 2 and nodes[-1] == table[-1]
            with pytest.raises(IndexError):
                nodes[2]
            assert client.stop_state() == 0

        # Reports travel to the driver as events.
        c0, c1 = results[0][0], results[1][0]
        c0.report("progress", 0, "epoch 1")
        c1.report("failed", 3, "Traceback (most recent call last):\n  boom \udcff\x00end")
        c0.report("done", 0, "")
        got = {}
        for ev in drain_events(srv, timeout=5.0):
            got.setdefault(ev[0], []).append(ev)
            if len(got) == 3:
                break
        assert got["progress"][0][1:3] == (0, 0) and got["progress"][0][3] == "epoch 1"
        node, code, text = got["failed"][0][1:]
        assert (node, code) == (1, 3) and "boom" in text and text.endswith("end")
        assert got["done"][0][1:3] == (0, 0)

        # STOP reaches the node: stop_state is grace_ms + 1.
        srv.stop(node=1, grace_ms=5000)
        deadline = time.monotonic() + 5.0
        while c1.stop_state() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c1.stop_state() == 5001
        assert c0.stop_state() == 0

        with pytest.raises(ValueError):
            c0.report("bogus", 0, "")
        for c, _, _ in results:
            c.close()
            c.close()  # idempotent
            with pytest.raises(ValueError, match="closed"):
                c.stop_state()
    finally:
        srv.close()
    srv.close()
    with pytest.raises(ValueError, match="closed"):
        srv.port
    with pytest.raises(ValueError, match="closed"):
        srv.nodes()


def test_reservation_four_nodes_with_roles():
    secret = E.random_secret()
    with E.RendezvousServer(secret, 4, num_ps=1, chief=True, evaluator=True,
                            host=HOST) as srv:
        results = run_reservation(srv, secret, 4)
        roles = [(n["role"], n["task_index"]) for n in srv.nodes()]
        assert roles == [("ps", 0), ("chief", 0), ("evaluator", 0), ("worker", 0)]
        for i, (client, nodes, pos) in enumerate(results):
            assert pos == i
            assert [(n["role"], n["task_index"]) for n in nodes] == roles
            client.close()


def test_reservation_timeout_names_missing_node():
    secret = E.random_secret()
    srv = E.RendezvousServer(secret, 3, host=HOST)
    clients = []
    try:
        for i in (0, 2):
            c = E.RendezvousClient(HOST, srv.port, secret, 10.0)
            c.register(i, HOST, f"exec-{i}", os.getpid(), [], 10.0)
            clients.append(c)
        drain_events(srv, timeout=0.5)  # let both registrations land
        t0 = time.monotonic()
        with pytest.raises(E.EmberTimeout) as info:
            srv.wait_ready(1.0)
        assert time.monotonic() - t0 < 5.0
        exc = info.value
        assert isinstance(exc, TimeoutError)
        assert exc.code == -4 and exc.name == "EMBER_ETIMEDOUT"
        assert re.search(r"missing node\(s\): 1\b", str(exc)), str(exc)
        assert [n["index"] for n in srv.nodes()] == [0, 2]

        # A client waiting for a spec that never comes times out too.
        with pytest.raises(E.EmberTimeout):
            clients[0].wait_spec(0.3)
    finally:
        for c in clients:
            c.close()
        srv.close()


def test_wrong_secret_rejected_then_reservation_completes():
    secret = E.random_secret()
    srv = E.RendezvousServer(secret, 2, host=HOST)
    try:
        with pytest.raises(E.EmberAuthError) as info:
            E.RendezvousClient(HOST, srv.port, E.random_secret(), 5.0)
        assert info.value.code == -7 and info.value.name == "EMBER_EAUTH"
        events = drain_events(srv, until="rejected", timeout=5.0)
        assert events and events[-1][0] == "rejected", events
        assert events[-1][3]  # names the peer and the reason

        results = run_reservation(srv, secret, 2)
        assert [pos for _, _, pos in results] == [0, 1]
        assert "ready" in [e[0] for e in drain_events(srv, until="ready")]
        for c, _, _ in results:
            c.close()
    finally:
        srv.close()


def test_lost_node_reported():
    secret = E.random_secret()
    with E.RendezvousServer(secret, 1, host=HOST, heartbeat_timeout_ms=1000) as srv:
        (client, _, _), = run_reservation(srv, secret, 1)
        drain_events(srv, until="ready")
        client.close()
        events = drain_events(srv, until="lost", timeout=10.0)
        assert events and events[-1][:2] == ("lost", 0), events


def test_malformed_frames_do_not_break_server():
    """10,000 random and malformed frames on a few hundred raw connections,
    then a normal 2-node reservation on the same server."""
    secret = E.random_secret()
    srv = E.RendezvousServer(secret, 2, host=HOST, handshake_timeout_ms=1000)
    port = srv.port
    rng = random.Random(1234)
    n_conns, frames_per_conn = 300, 34  # 10,200 frames
    stats = {"frames": 0}
    lock = threading.Lock()

    def garbage_frame(r):
        kind = r.randrange(8)
        if kind == 0:  # pure noise
            return r.randbytes(r.randrange(1, 64))
        if kind == 1:  # bad magic
            return frame(r.randrange(1, 40), r.randbytes(8), magic=r.randbytes(4))
        if kind == 2:  # bad version
            return frame(MSG_AUTH, r.randbytes(64), version=r.randrange(2, 65536))
        if kind == 3:  # a length far over any limit, no payload behind it
            return frame(r.choice([MSG_AUTH, MSG_REGISTER, MSG_REPORT]), b"",
                         length=r.choice([0xFFFFFFFF, 1 << 30, (4 << 20) + 1]))
        if kind == 4:  # valid header, unknown type
            return frame(r.randrange(39, 65536), r.randbytes(r.randrange(0, 32)))
        if kind == 5:  # AUTH of the right size with a garbage MAC
            return frame(MSG_AUTH, r.randbytes(64))
        if kind == 6:  # header cut short
            return frame(MSG_AUTH, r.randbytes(64))[: r.randrange(1, 12)]
        # valid header of a known type, garbage payload
        return frame(r.choice([MSG_REGISTER, MSG_REPORT, MSG_HEARTBEAT, MSG_SPEC, MSG_STOP,
                               MSG_AUTH_OK, MSG_REFUSED, MSG_CHALLENGE]),
                     r.randbytes(r.randrange(0, 200)))

    def garbage_register(r):
        """REGISTER payloads that are malformed, or well formed with an index
        outside 0..num_nodes-1, so no fuzz connection takes a real slot."""
        host = r.randbytes(r.randrange(0, 20))
        payload = (struct.pack("<I", r.randrange(2, 1 << 32)) +
                   struct.pack("<I", len(host)) + host + struct.pack("<I", 0) +
                   struct.pack("<II", 1, r.randrange(0, 20)) +
                   b"".join(struct.pack("<H", 1) for _ in range(r.randrange(0, 20))))
        k = r.randrange(4)
        if k == 0:
            payload = payload[: r.randrange(0, len(payload))]  # truncated
        elif k == 1:  # a string length past the end
            payload = struct.pack("<II", 0, 0xFFFFFFF0) + host
        elif k == 2:
            payload += r.randbytes(r.randrange(1, 16))  # trailing junk
        return frame(MSG_REGISTER, payload)

    def attacker(seed, count):
        r = random.Random(seed)
        socks = []
        sent = 0
        try:
            for _ in range(count):
                s = socket.create_connection((HOST, port), timeout=5.0)
                socks.append(s)
                try:
                    mode = r.randrange(4)
                    if mode == 0:
                        # Authenticate properly, then send garbage frames.
                        raw_authenticate(s, secret)
                        data = b"".join(garbage_register(r) if r.random() < 0.5
                                        else garbage_frame(r)
                                        for _ in range(frames_per_conn))
                    else:
                        data = b"".join(garbage_frame(r) for _ in range(frames_per_conn))
                    if mode == 1:
                        # Trickle: a few frames in small writes, then stay open.
                        for i in range(0, min(len(data), 300), 37):
                            s.sendall(data[i:i + 37])
                    else:
                        s.sendall(data)
                    sent += frames_per_conn
                except OSError:
                    sent += frames_per_conn  # the server hung up mid-stream: fine
                if len(socks) > 20:
                    socks.pop(0).close()
        finally:
            for s in socks:
                s.close()
        with lock:
            stats["frames"] += sent

    t0 = time.monotonic()
    try:
        threads = [Worker(attacker, rng.random(), n_conns // 6) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join_result(60.0)
        assert stats["frames"] >= 10000
        events = drain_events(srv, timeout=1.0)
        assert events and all(e[0] == "rejected" for e in events), set(e[0] for e in events)
        assert srv.nodes() == []

        results = run_reservation(srv, secret, 2)
        assert [pos for _, _, pos in results] == [0, 1]
        for c, _, _ in results:
            c.close()
    finally:
        srv.close()
    assert time.monotonic() - t0 < 30.0


# ---------------------------------------------------------------- batch codec

def sample_columns(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, 784), dtype=np.float32)
    y = rng.integers(0, 10, size=n, dtype=np.int64)
    w = rng.random(n)
    flags = rng.integers(0, 2, size=n).astype(np.bool_)
    strs = [f"row-{seed}-{i}-".encode() * (i % 4) for i in range(n)]
    cols = [("x", E.DT_F32, 784, x, None), ("y", E.DT_I64, 1, y, None),
            ("w", E.DT_F64, 1, w, None), ("flag", E.DT_BOOL, 1, flags, None),
            bytes_column("s", strs)]
    return cols, (x, y, w, flags, strs)


def test_encode_decode_roundtrip():
    n = 37
    cols, (x, y, w, flags, strs) = sample_columns(n, seed=3)
    data = E.encode_batch(cols, n)
    assert isinstance(data, bytes)
    nrows, desc = E.decode_batch(data)
    assert nrows == n
    assert [d[:3] for d in desc] == [("x", E.DT_F32, 784), ("y", E.DT_I64, 1),
                                     ("w", E.DT_F64, 1), ("flag", E.DT_BOOL, 1),
                                     ("s", E.DT_BYTES, 0)]
    for d in desc:
        assert d[3] % 8 == 0 or d[1] == E.DT_BYTES
    _, _, _, off, nbytes, ooff = desc[0]
    assert nbytes == x.nbytes and ooff == -1
    np.testing.assert_array_equal(
        np.frombuffer(data, np.float32, n * 784, off).reshape(n, 784), x)
    np.testing.assert_array_equal(np.frombuffer(data, np.int64, n, desc[1][3]), y)
    np.testing.assert_array_equal(np.frombuffer(data, np.float64, n, desc[2][3]), w)
    np.testing.assert_array_equal(np.frombuffer(data, np.bool_, n, desc[3][3]), flags)
    _, _, _, off, nbytes, ooff = desc[4]
    offs = np.frombuffer(data, np.uint64, n + 1, ooff)
    got = [data[off + int(offs[i]):off + int(offs[i + 1])] for i in range(n)]
    assert got == strs and nbytes == sum(map(len, strs))

    # Any bytes-like input, also one at an odd address.
    assert E.decode_batch(bytearray(data)) == (nrows, desc)
    odd = memoryview(b"\0" + data)[1:]
    assert E.decode_batch(odd) == (nrows, desc)

    # Empty batches and zero rows.
    assert E.decode_batch(E.encode_batch([], 0)) == (0, [])
    z = E.encode_batch([("a", E.DT_I32, 2, b"", None), bytes_column("b", [])], 0)
    assert [d[:3] for d in E.decode_batch(z)[1]] == [("a", E.DT_I32, 2), ("b", E.DT_BYTES, 0)]

    # Offsets given as raw bytes or int64 work too.
    raw = E.encode_batch([("s", E.DT_BYTES, 0, b"abcde",
                           np.array([0, 2, 5], np.uint64).tobytes())], 2)
    raw2 = E.encode_batch([("s", E.DT_BYTES, 0, b"abcde", np.array([0, 2, 5], np.int64))], 2)
    assert raw == raw2


def test_decode_rejects_garbage():
    data = E.encode_batch(sample_columns(5)[0], 5)
    for bad in (b"", b"\x01\x00\x00\x00", data[:-1], data[:40], data + b"\0" * 9):
        with pytest.raises(E.EmberError) as info:
            E.decode_batch(bad)
        assert info.value.code == -6 and info.value.name == "EMBER_EPROTO"
    rng = random.Random(5)
    for _ in range(2000):
        b = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            E.decode_batch(bytes(b))
        except E.EmberError:
            pass


def test_column_validation():
    x = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="'feat'"):
        E.encode_batch([("feat", E.DT_F32, 3, x, None)], 5)
    with pytest.raises(ValueError, match="'feat'"):
        E.encode_batch([("feat", E.DT_F64, 3, x, None)], 4)
    with pytest.raises(ValueError, match="'lab'"):
        E.encode_batch([("lab", E.DT_I64, 1, np.zeros(4, np.int32), None)], 4)
    with pytest.raises(ValueError, match="'s'.*offsets"):
        E.encode_batch([("s", E.DT_BYTES, 0, b"ab", None)], 2)
    with pytest.raises(ValueError, match="'s'"):
        E.encode_batch([("s", E.DT_BYTES, 0, b"ab", np.array([0, 2], np.uint64))], 2)
    with pytest.raises(ValueError, match="'s'"):
        E.encode_batch([("s", E.DT_BYTES, 0, b"ab", np.array([0, 1, 2], np.uint32))], 2)
    with pytest.raises(ValueError, match="dtype"):
        E.encode_batch([("q", 99, 1, b"", None)], 0)
    with pytest.raises(TypeError, match="'nc'"):
        E.encode_batch([("nc", E.DT_F32, 2, np.zeros((3, 4), np.float32)[:, :2], None)], 3)
    with pytest.raises(ValueError):
        E.encode_batch([("a", E.DT_F32, 1)], 1)
    with pytest.raises(ValueError):
        E.encode_batch([], -1)
    with pytest.raises(TypeError):
        E.encode_batch(5, 1)
    # Inconsistent BYTES offsets are caught by libember.
    with pytest.raises(E.EmberError):
        E.encode_batch([("s", E.DT_BYTES, 0, b"ab", np.array([0, 3, 2], np.uint64))], 2)


# ---------------------------------------------------------------- feed

def test_feed_end_to_end():
    secret = E.random_secret()
    n_parts, n_batches, rows = 2, 6, 128
    srv = E.FeedServer(secret, host=HOST, queue_bytes=2 << 20)  # small: back-pressure

    def batch(part, b):
        rng = np.random.default_rng(1000 * part + b)
        x = rng.random((rows, 784), dtype=np.float32)
        y = rng.integers(0, 10, size=rows, dtype=np.int64)
        s = [f"p{part}b{b}r{i}".encode() * (1 + i % 3) for i in range(rows)]
        bid = np.full(rows, b, np.int32)
        return x, y, s, bid

    def producer(part):
        with E.FeedClient(HOST, srv.port, secret, part, timeout_s=10.0) as c:
            for b in range(n_batches):
                x, y, s, bid = batch(part, b)
                c.send([("image", E.DT_F32, 784, x, None), ("label", E.DT_I64, 1, y, None),
                        bytes_column("text", s), ("batch", E.DT_I32, 1, bid, None)],
                       rows, 10.0)
            c.end_partition(20.0)
            with pytest.raises(E.EmberError):  # already ended
                c.end_partition(1.0)

    try:
        workers = [Worker(producer, p) for p in range(n_parts)]
        for w in workers:
            w.start()
        seen = set()
        while len(seen) < n_parts * n_batches:
            item = srv.next(10.0)
            assert item is not None, "feed stalled"
            assert item.kind == "batch" and item.nrows == rows
            names = [c[0] for c in item.columns]
            assert names == ["image", "label", "text", "batch"]
            image = column_array(item, item.columns[0], np.float32)
            label = column_array(item, item.columns[1], np.int64)
            bid = column_array(item, item.columns[3], np.int32)
            b = int(bid[0])
            key = (item.partition, b)
            assert key not in seen, f"batch {key} delivered twice"
            seen.add(key)
            x, y, s, _ = batch(item.partition, b)
            np.testing.assert_array_equal(image, x)
            np.testing.assert_array_equal(label, y)
            assert column_strings(item, item.columns[2]) == s
            # The view keeps the item alive after the name is gone.
            del item
            assert float(image.sum()) == pytest.approx(float(x.sum()), rel=1e-5)
        for w in workers:
            w.join_result()
        st = srv.stats()
        assert st["batches_received"] == n_parts * n_batches
        assert st["records_received"] == n_parts * n_batches * rows
        assert st["partitions_acked"] == n_parts
        assert set(st) == {"batches_received", "records_received", "bytes_received",
                           "partitions_acked", "duplicate_partitions", "producers_rejected",
                           "shm_producers"}

        # A retried partition is acknowledged but not delivered twice.
        producer(0)
        assert srv.next(0.3) is None
        assert srv.stats()["duplicate_partitions"] == 1

        # END_FEED from the driver yields "end", and then "end" forever.
        with E.FeedClient(HOST, srv.port, secret, 0) as driver:
            driver.end_feed(10.0)
        end = srv.next(10.0)
        assert end is not None and end.kind == "end" and end.nrows == 0
        assert end.columns == [] and len(memoryview(end)) == 0
        assert srv.next(0).kind == "end"
    finally:
        srv.close()
    with pytest.raises(ValueError, match="closed"):
        srv.next(0)


def test_feed_delivers_each_batch_once():
    """Checks the count per (partition, batch) precisely."""
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST) as srv:
        def producer(part):
            c = E.FeedClient(HOST, srv.port, secret, part)
            for b in range(5):
                c.send([("b", E.DT_I32, 1, np.full(3, b, np.int32), None)], 3, 10.0)
            c.end_partition(20.0)
            c.close()

        workers = [Worker(producer, p) for p in range(3)]
        for w in workers:
            w.start()
        got = []
        while len(got) < 15:
            item = srv.next(10.0)
            assert item is not None
            got.append((item.partition, int(column_array(item, item.columns[0], np.int32)[0])))
        for w in workers:
            w.join_result()
        assert sorted(got) == [(p, b) for p in range(3) for b in range(5)]


def test_feed_results_roundtrip():
    secret = E.random_secret()
    fd, port = E.reserve_port(HOST)  # the reserved-port path: handed to the server
    srv = E.FeedServer(secret, listen_fd=fd)
    assert srv.port == port
    rows = 50

    def producer():
        out = []
        with E.FeedClient(HOST, port, secret, 7, want_results=True, timeout_s=10.0) as c:
            for b in range(3):
                x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + b
                c.send([("x", E.DT_F32, 4, x, None)], rows, 10.0)
                res = c.recv_results(10.0)
                assert res.kind == "results" and res.partition == 7 and res.source == 0
                (name, dt, width, off, nbytes, ooff), tag = res.columns
                assert (name, dt, width) == ("sum", E.DT_F64, 1)
                sums = np.frombuffer(res, np.float64, rows, off)
                np.testing.assert_allclose(sums, x.sum(axis=1))
                assert column_strings(res, tag) == [b"b%d" % b] * rows
                out.append(sums.copy())
                with pytest.raises(BufferError):
                    res.release()
                del sums
                res.release()
                res.release()
                with pytest.raises(ValueError, match="released"):
                    memoryview(res)
            c.end_partition(10.0)
        return out

    try:
        w = Worker(producer)
        w.start()
        for b in range(3):
            item = srv.next(10.0)
            assert item is not None and item.kind == "batch" and item.partition == 7
            assert item.flags & 1  # EMBER_FEED_WANT_RESULTS
            x = column_array(item, item.columns[0], np.float32)
            srv.send_results(item.source,
                             [("sum", E.DT_F64, 1, x.sum(axis=1, dtype=np.float64), None),
                              bytes_column("tag", [b"b%d" % b] * item.nrows)],
                             item.nrows, 10.0)
        assert len(w.join_result()) == 3
        # The producer has closed its connection; the server's loop notices
        # that on its own thread, so results for it fail once it has.
        deadline = time.monotonic() + 10.0
        while True:
            try:
                srv.send_results(item.source, [], 0, 1.0)
            except E.EmberError as exc:
                assert exc.name == "EMBER_ENOTFOUND", exc
                break
            assert time.monotonic() < deadline, "results for a closed producer still accepted"
            time.sleep(0.01)
        with pytest.raises(ValueError, match="'sum'"):
            srv.send_results(item.source, [("sum", E.DT_F64, 1, b"1234", None)], 1, 1.0)
    finally:
        srv.close()


def test_feed_terminate_aborts_producer():
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST) as srv:
        c = E.FeedClient(HOST, srv.port, secret, 1)
        c.send([("v", E.DT_U8, 1, b"abc", None)], 3, 5.0)
        item = srv.next(5.0)
        assert item.kind == "batch"
        srv.terminate()
        with pytest.raises(E.EmberAborted) as info:
            c.end_partition(5.0)
        assert info.value.code == -11 and info.value.name == "EMBER_EABORTED"
        assert srv.next(0).kind == "end"
        c.close()


def test_feed_wrong_secret():
    with E.FeedServer(E.random_secret(), host=HOST) as srv:
        with pytest.raises(E.EmberAuthError):
            E.FeedClient(HOST, srv.port, E.random_secret(), 0, timeout_s=5.0)
        deadline = time.monotonic() + 5.0
        while srv.stats()["producers_rejected"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.stats()["producers_rejected"] == 1


def test_feed_encrypted_round_trip_report_and_mode_mismatch():
    """encrypt=True on both ends: batches and a producer's failure report
    arrive as in clear; an end in the other mode is refused, and told why."""
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST, shm=False, encrypt=True) as srv:
        with E.FeedClient(HOST, srv.port, secret, 0, shm=False, encrypt=True) as c:
            c.send([("x", E.DT_I64, 1, np.arange(300_000, dtype=np.int64), None)], 300_000,
                   10.0)
            item = srv.next(10.0)
            assert item is not None and item.nrows == 300_000
            assert int(column_array(item, item.columns[0], np.int64)[-1]) == 299_999
            item.release()
        with E.FeedClient(HOST, srv.port, secret, 1, shm=False, encrypt=True, call=7) as c:
            c.fail("bad input", 5.0)
        item = srv.next(10.0)
        while item is not None and item.kind != "error":  # the partition's start first
            item = srv.next(10.0)
        assert item is not None and "bad input" in bytes(item).decode()
        with pytest.raises(E.EmberAuthError, match="the peer sends in clear"):
            E.FeedClient(HOST, srv.port, secret, 2, shm=False, timeout_s=5.0)
    with E.FeedServer(secret, host=HOST, shm=False) as srv:
        with pytest.raises(E.EmberAuthError, match="the peer encrypts"):
            E.FeedClient(HOST, srv.port, secret, 0, shm=False, encrypt=True, timeout_s=5.0)


def test_feed_item_buffer_lifetime():
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST) as srv:
        with E.FeedClient(HOST, srv.port, secret, 0) as c:
            c.send([("x", E.DT_I64, 2, np.arange(8, dtype=np.int64), None)], 4, 5.0)
            item = srv.next(5.0)
        mv = memoryview(item)
        assert mv.readonly and mv.format == "B" and mv.nbytes > 64
        with pytest.raises(BufferError):
            item.release()
        mv.release()
        assert "kind=batch" in repr(item) and "nrows=4" in repr(item)
        arr = column_array(item, item.columns[0], np.int64)
        with pytest.raises(ValueError):
            arr[0, 0] = 1  # read-only
        assert arr.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
        del item  # the array keeps the buffer alive
        assert arr.sum() == 28


def test_closed_objects_raise():
    secret = E.random_secret()
    srv = E.FeedServer(secret, host=HOST)
    c = E.FeedClient(HOST, srv.port, secret, 0)
    c.close()
    for call in (lambda: c.send([], 0, 1.0), lambda: c.end_partition(1.0),
                 lambda: c.end_feed(1.0), lambda: c.recv_results(1.0)):
        with pytest.raises(ValueError, match="FeedClient is closed"):
            call()
    srv.close()
    srv.close()
    for call in (lambda: srv.port, lambda: srv.next(0), srv.terminate, srv.stats,
                 lambda: srv.send_results(0, [], 0, 1.0)):
        with pytest.raises(ValueError, match="FeedServer is closed"):
            call()


def test_close_while_blocked_in_another_thread():
    """close() from one thread while another is blocked in next()/next_event()
    must neither crash nor hang: the blocked call ends with ValueError."""
    secret = E.random_secret()
    fsrv = E.FeedServer(secret, host=HOST)
    rsrv = E.RendezvousServer(secret, 1, host=HOST)
    w1 = Worker(fsrv.next, 30.0)
    w2 = Worker(rsrv.next_event, 30.0)
    w1.start()
    w2.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    fsrv.close()
    rsrv.close()
    for w in (w1, w2):
        with pytest.raises(ValueError, match="closed"):
            w.join_result(5.0)
    assert time.monotonic() - t0 < 5.0


def test_next_event_from_many_threads():
    """RendezvousServer methods may run concurrently on several threads."""
    secret = E.random_secret()
    with E.RendezvousServer(secret, 2, host=HOST) as srv:
        got_ready = threading.Event()

        def poll():
            events = []
            while not got_ready.is_set():
                ev = srv.next_event(0.1)
                if ev is not None:
                    events.append(ev)
                    if ev[0] == "ready":
                        got_ready.set()
            return events

        waiters = [Worker(srv.wait_ready, 20.0) for _ in range(3)]
        pollers = [Worker(poll) for _ in range(2)]
        for w in waiters + pollers:
            w.start()
        results = run_reservation(srv, secret, 2)
        for w in waiters:
            w.join_result()
        kinds = [e[0] for p in pollers for e in p.join_result()]
        assert kinds.count("registered") == 2 and kinds.count("ready") == 1
        for c, _, _ in results:
            c.close()
