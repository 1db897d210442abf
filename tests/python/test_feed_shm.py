"""The feed's shared-memory transport through the extension: the FeedClient
and FeedServer shm options, and identical items over shared memory and TCP."""
import numpy as np
import pytest

from ember import _ember as E

HOST = "127.0.0.1"


def _columns(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.random((rows, 784), dtype=np.float32)
    y = rng.integers(0, 10, size=rows, dtype=np.int64)
    return [("image", E.DT_F32, 784, x, None), ("label", E.DT_I64, 1, y, None)]


def _feed(srv, secret, part, shm, batches, rows=64, shm_bytes=0):
    with E.FeedClient(HOST, srv.port, secret, part, timeout_s=10.0, shm=shm,
                      shm_bytes=shm_bytes) as c:
        assert c.uses_shm is False  # decided by the first send
        for b in range(batches):
            c.send(_columns(rows, b), rows, 10.0)  # same data for every partition
        used = c.uses_shm
        items = [srv.next(10.0) for _ in range(batches)]
        c.end_partition(10.0)
    return used, items


def test_shm_and_tcp_items_are_identical():
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST) as srv:
        # 64 KiB ring: the ~200 KB batches go through it split
        used_shm, via_shm = _feed(srv, secret, 1, True, 4, shm_bytes=65536)
        used_tcp, via_tcp = _feed(srv, secret, 1 + (1 << 20), False, 4)
        assert used_shm is True and used_tcp is False
        for a, b in zip(via_shm, via_tcp):
            assert a.kind == b.kind == "batch" and a.nrows == b.nrows == 64
            assert a.columns == b.columns
            assert bytes(memoryview(a)) == bytes(memoryview(b))
        # a ring large enough for whole batches (encoded in place): the same
        _, again = _feed(srv, secret, 1 + (2 << 20), True, 4)
        for a, b in zip(via_shm, again):
            assert bytes(memoryview(a)) == bytes(memoryview(b))
        assert srv.stats()["shm_producers"] == 2


def test_server_can_decline_shared_memory():
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST, shm=False) as srv:
        used, items = _feed(srv, secret, 3, True, 2)
        assert used is False
        assert [i.nrows for i in items] == [64, 64]
        assert srv.stats()["shm_producers"] == 0


def test_env_turns_shared_memory_off(monkeypatch):
    monkeypatch.setenv("EMBER_FEED_SHM", "0")
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST) as srv:
        used, _ = _feed(srv, secret, 4, None, 1)
        assert used is False


def test_fail_and_bad_options():
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST) as srv:
        c = E.FeedClient(HOST, srv.port, secret, 5, timeout_s=10.0)
        c.send(_columns(8, 1), 8, 10.0)
        c.fail("cannot read partition 5", 10.0)
        assert srv.next(10.0).nrows == 8
        with pytest.raises(E.EmberError):
            c.send(_columns(8, 2), 8, 1.0)
        c.close()
        assert srv.stats()["partitions_acked"] == 0
        with pytest.raises(E.EmberError, match="shm_bytes"):
            E.FeedClient(HOST, srv.port, secret, 6, shm_bytes=1000)
        with pytest.raises(ValueError):
            E.FeedClient(HOST, srv.port, secret, 6, shm_bytes=-1)


@pytest.mark.parametrize("shm", [True, False])
def test_failed_producer_surfaces_in_the_trainer_after_its_batches(shm):
    """A feeding task that fails marks it in the feed: the trainer first gets
    the batches it sent, then, with on_producer_error="raise", an exception
    naming the partition and the task's reason (default: a log line and
    DataFeed.producer_errors, waiting for Spark's retry)."""
    from ember.node import DataFeed, FeedProducerError

    secret = E.random_secret()
    for policy in ("raise", "wait"):
        srv = E.FeedServer(secret, host="127.0.0.1")
        try:
            with E.FeedClient("127.0.0.1", srv.port, secret, 3, timeout_s=10.0, shm=shm) as c:
                ids = np.arange(100, dtype=np.int64)
                c.send([("id", E.DT_I64, 1, ids, None)], 100, 10.0)
                assert c.uses_shm is shm
                c.fail("partition 3 failed after 100 records: OSError: disk gone", 5.0)
            feed = DataFeed(srv, feed_timeout=2.0, on_producer_error=policy)
            got = feed.next_batch(100)
            assert list(got.columns[0]) == list(range(100))
            if policy == "raise":
                with pytest.raises(FeedProducerError, match="producer of partition 3 failed.*disk gone"):
                    feed.next_batch(10)
            else:
                with pytest.raises(TimeoutError):  # keeps waiting for the retry's data
                    feed.next_batch(10)
                assert len(feed.producer_errors) == 1 and "disk gone" in feed.producer_errors[0]
        finally:
            srv.close()
