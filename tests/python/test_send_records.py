"""FeedClient.send_records: a chunk of records converted straight into the
batch's place (a shared-memory ring, or the client's buffer for TCP and for
batches over half the ring) arrives byte-identical to records_to_columns()
then send(); a chunk the C path does not take, or whose later records
disagree with its first, sends nothing, and _columns.send_records converts
it in Python (or raises the error naming the record) instead."""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest

from ember import _columns, _ember as E
from ember.errors import EmberFeedError

from test_records_c import FAST_CHUNKS, SLOW_CHUNKS, images

HOST = "127.0.0.1"
# shm_bytes for each way a batch can go: in place in the ring, split through a
# small ring from the client's buffer, TCP from the client's buffer
TRANSPORTS = {"ring": (True, 4 << 20), "split": (True, 65536), "tcp": (False, 0)}


def _items(srv: Any, secret: bytes, part: int, shm: bool, shm_bytes: int,
           chunks: List[List[Any]], in_place: bool) -> List[Any]:
    """Feeds chunks as one partition, in place or converted then sent; returns
    the server's items for them (none for a chunk send_records declined)."""
    layout: Dict[str, Any] = {}
    sent = 0
    with E.FeedClient(HOST, srv.port, secret, part, timeout_s=10.0, shm=shm,
                      shm_bytes=shm_bytes) as c:
        for chunk in chunks:
            if in_place:
                if "fields" not in layout:
                    layout["fields"] = _columns._record_fields(chunk[0])
                done = c.send_records(list(chunk), layout["fields"], layout.get("refs"), 10.0)
                assert done is not None
                layout["refs"], nbytes = done
                assert nbytes == sum(np.asarray(col[3]).nbytes if col[4] is None
                                     else len(col[3]) + 8 * (len(chunk) + 1)
                                     for col in _columns.records_to_columns(
                                         list(chunk), "p", 0, dict(layout))[0])
            else:
                cols, n = _columns.records_to_columns(list(chunk), "p", 0, layout)
                c.send(cols, n, 10.0)
            sent += 1
        assert c.uses_shm is shm
        items = [srv.next(10.0) for _ in range(sent)]
        c.end_partition(10.0)
    return items


@pytest.mark.parametrize("name", sorted(FAST_CHUNKS))
def test_in_place_batches_equal_converted_ones(name):
    records = FAST_CHUNKS[name]
    chunks = [records, records[::-1]]  # the second chunk follows the first's layout
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST) as srv:
        for t, (shm, shm_bytes) in enumerate(TRANSPORTS.values()):
            got = _items(srv, secret, 10 * t, shm, shm_bytes, chunks, in_place=True)
            want = _items(srv, secret, 10 * t + 1, shm, shm_bytes, chunks, in_place=False)
            for g, w in zip(got, want):
                assert g.kind == w.kind == "batch" and g.nrows == w.nrows == len(records)
                assert g.columns == w.columns
                assert bytes(memoryview(g)) == bytes(memoryview(w))


def test_large_batches_use_every_way():
    """A 3 MB chunk of images: in place in a 16 MiB ring, split through a
    4 MiB one, and over TCP; the node gets every byte."""
    records = [(x, i % 10) for i, x in enumerate(images(1000))]
    want = np.stack([r[0] for r in records])
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST, queue_bytes=64 << 20) as srv:
        for t, (shm, shm_bytes) in enumerate([(True, 16 << 20), (True, 4 << 20), (False, 0)]):
            [item] = _items(srv, secret, t, shm, shm_bytes, [records], in_place=True)
            names, cols = _columns.item_columns(item)
            assert names == ["0", "1"]
            assert np.array_equal(cols[0], want)
            assert cols[1].tolist() == [i % 10 for i in range(1000)]


def _declines(records: List[Any], refs: Any = None) -> None:
    """send_records answers None and the node gets nothing from the partition."""
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST) as srv:
        for t, (shm, shm_bytes) in enumerate(TRANSPORTS.values()):
            with E.FeedClient(HOST, srv.port, secret, t, timeout_s=10.0, shm=shm,
                              shm_bytes=shm_bytes) as c:
                fields = _columns._record_fields(records[0])
                assert c.send_records(list(records), fields, refs, 10.0) is None
                c.end_partition(10.0)
            assert srv.stats()["batches_received"] == 0


@pytest.mark.parametrize("name", sorted(SLOW_CHUNKS))
def test_chunks_off_the_c_path_send_nothing(name):
    _declines(SLOW_CHUNKS[name])


@pytest.mark.parametrize("records", [
    [(np.zeros(4, np.float32), 1), (np.zeros(5, np.float32), 2)],  # a later shape
    [(np.zeros(4, np.float32), 1), (np.zeros(4, np.float64), 2)],  # a later dtype
    [(1,), (2,), (2 ** 70,)],                                        # beyond int64
    [([1.0, 2.0],), ([1.0, "x"],)],                                  # a str in a vector
    [("a",), (b"b",)],                                               # bytes among str
], ids=["shape", "dtype", "int_overflow", "vector_item", "text_kind"])
def test_a_record_that_disagrees_with_the_plan_cancels_the_batch(records):
    """The plan reads each column's first value; the write pass finds the
    record that disagrees, drops the begun batch, and sends nothing."""
    _declines(records)


def test_refs_that_disagree_send_nothing():
    _declines([(np.zeros(4, np.float32), 1)], refs=[("array", (5,)), ("int", None)])


def test_the_fallback_converts_or_names_the_record():
    """_columns.send_records: in place when the C path takes the chunk, else
    the Python path's columns through send(), or its error naming the record."""
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST) as srv:
        with E.FeedClient(HOST, srv.port, secret, 0, timeout_s=10.0) as c:
            layout: Dict[str, Any] = {}
            assert _columns.send_records(c, [(1.5, 2), (2.5, 3)], "p", 0, layout, 10.0) == (2, 32)
            assert layout["refs"] == [("float", None), ("int", None)]
            slow = [(1.5, 2 ** 70)]  # numpy makes an object column of it: the error path
            with pytest.raises(EmberFeedError) as err:
                _columns.records_to_columns(list(slow), "p", 2, dict(layout))
            with pytest.raises(EmberFeedError) as err2:
                _columns.send_records(c, list(slow), "p", 2, layout, 10.0)
            assert str(err2.value) == str(err.value)
            assert _columns.send_records(c, [(0.5, 7)], "p", 3, layout, 10.0) == (1, 16)
            first, second = srv.next(10.0), srv.next(10.0)
            c.end_partition(10.0)
        assert (first.nrows, second.nrows) == (2, 1)
        assert _columns.item_columns(second)[1][1].tolist() == [7]


def test_wrong_arguments():
    secret = E.random_secret()
    with E.FeedServer(secret, host=HOST) as srv:
        with E.FeedClient(HOST, srv.port, secret, 0, timeout_s=10.0) as c:
            with pytest.raises(TypeError):
                c.send_records((1, 2), None, None, 10.0)
            with pytest.raises(TypeError):
                c.send_records([1, 2], "x", None, 10.0)
            with pytest.raises(ValueError):
                c.send_records([1, 2], None, None, -1.0)
            assert c.send_records([], None, None, 10.0) is None
            c.close()
            with pytest.raises(ValueError):
                c.send_records([1], None, None, 10.0)


def test_in_place_max_and_the_rows_of_the_next_chunk():
    """in_place_max is half the ring less a record header once the first send
    chose the ring (0 before, and over TCP); rows_in_place cuts a partition's
    chunks so that each batch takes at most 3/4 of it."""
    secret = E.random_secret()
    records = [(x, 1) for x in images(4)]
    with E.FeedServer(secret, host=HOST) as srv:
        for part, (shm, want) in enumerate([(True, (4 << 20) // 2 - 16), (False, 0)]):
            with E.FeedClient(HOST, srv.port, secret, part, timeout_s=10.0, shm=shm,
                              shm_bytes=4 << 20) as c:
                assert c.in_place_max == 0
                _columns.send_records(c, list(records), "p", 0, {}, 10.0)
                assert c.in_place_max == want
                srv.next(10.0)
                c.end_partition(10.0)
    room = (4 << 20) // 2 - 16
    per_record = 784 * 4 + 8
    rows = _columns.rows_in_place(room, 1024, 1024, 1024 * per_record)
    assert rows * per_record <= room * 3 // 4 < (rows + 1) * per_record
    assert _columns.rows_in_place(room, 1024, 100, 100 * per_record) == 1024  # fits already
    assert _columns.rows_in_place(0, 1024, 1024, 1024 * per_record) == 1024   # TCP: as asked
    assert _columns.rows_in_place(room, 1024, 1, 10 * room) == 1               # never 0
    assert _columns.rows_in_place(room, 1024, 1024, 0) == 1024                 # size unknown
