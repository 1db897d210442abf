# Type stub of ember._ember, the CPython extension (python/ember/_ember*.c).
#
# Written by hand from the C sources: each signature follows the function's
# kwlist and PyArg_Parse format (METH_O / METH_VARARGS arguments are
# positional-only, "$" makes the rest keyword-only), each default its C
# initializer, each return type what the function builds.  Keep it in step
# with the C: `make typecheck` runs mypy's stubtest, which fails on a name
# that is in one and not the other, or a constant whose value differs.
#
# Timeouts are seconds (float or int; inf waits for ~100 years), converted
# by embpy_timeout_conv; ports are ints 0..65535 (embpy_port_conv).

import builtins
import os
from collections.abc import Sequence
from typing import Any, Final, Literal, SupportsIndex, TypeAlias, TypeVar, final, overload

import numpy as np
from _typeshed import ReadableBuffer, StrOrBytesPath, WriteableBuffer
from numpy.typing import NDArray
from typing_extensions import Self

from ember.errors import EmberError as EmberError

# Bulk data goes through the buffer protocol.  numpy's stubs give ndarray the
# protocol's __buffer__ only for Python >= 3.12, so arrays are named here too.
_Readable: TypeAlias = ReadableBuffer | NDArray[Any]
_Writable: TypeAlias = WriteableBuffer | NDArray[Any]
_W = TypeVar("_W", bound=_Writable)

__version__: str
COMPILER: str  # "gcc 12.2.0", "clang ...": the compiler that built the extension

# feed column dtypes (ember_dtype)
DT_F32: Final = 1
DT_F64: Final = 2
DT_I32: Final = 3
DT_I64: Final = 4
DT_U8: Final = 5
DT_BYTES: Final = 6
DT_BOOL: Final = 7

# tf.train.Example feature kinds and spec flags (ember/example.h)
EX_BYTES: Final = 1
EX_FLOAT: Final = 2
EX_INT64: Final = 3
EX_OPTIONAL: Final = 1

# TFRecord compression (0: none)
TFR_GZIP: Final = 1
TFR_ZLIB: Final = 2

# ---------------------------------------------------------------- exceptions
# EmberError is ember.errors.EmberError (the extension takes it as its base
# when it loads).  Each class below carries its C status as class attributes.

class EmberTimeout(EmberError, TimeoutError):
    code: int  # EMBER_ETIMEDOUT
    name: str

class EmberAuthError(EmberError):
    code: int  # EMBER_EAUTH
    name: str

class EmberAborted(EmberError):
    code: int  # EMBER_EABORTED
    name: str

class EmberCorruptError(EmberError):
    code: int  # EMBER_ECORRUPT (raised also for EMBER_ETRUNCATED)
    name: str

class EmberSchemaError(EmberError, ValueError):
    code: int  # EMBER_ESCHEMA
    name: str

class EmberFileNotFoundError(EmberError, FileNotFoundError):
    code: int  # EMBER_ENOTFOUND
    name: str

class EmberPermissionError(EmberError, PermissionError):
    code: int  # EMBER_EPERM
    name: str

# ---------------------------------------------------------------- batches

# (name, dtype, width, data, offsets): data holds nrows x width values of
# dtype (DT_*); offsets is None except for DT_BYTES (nrows + 1 uint64).
_ColumnSpec: TypeAlias = tuple[str, int, int, _Readable, _Readable | None]
# (name, dtype, width, offset, nbytes, offsets_offset): byte offsets into the
# decoded buffer; offsets_offset is -1 unless dtype is DT_BYTES.
_DecodedColumn: TypeAlias = tuple[str, int, int, int, int, int]

def random_secret() -> bytes: ...
def reserve_port(host: str = "", listen: bool = False, backlog: int = 4096) -> tuple[int, int]: ...
def encode_batch(columns: Sequence[_ColumnSpec], nrows: int) -> bytes: ...
def decode_batch(data: ReadableBuffer, /) -> tuple[int, list[_DecodedColumn]]: ...

# records_to_columns: a column's (kind, row shape or None), kept across the
# chunks of a partition.
_Ref: TypeAlias = tuple[str, tuple[int, ...] | None]
# a str/bytes column: (name, None, 0, the joined bytes, n + 1 uint64 offsets,
# None); any other: (name, numpy type character, width, data, None, shape)
_RecordsColumn: TypeAlias = (
    tuple[str, None, int, bytes, bytearray, None]
    | tuple[str, str, int, bytearray, None, tuple[int, ...]]
)

def records_to_columns(
    records: list[Any] | PickledRecords | tuple[PickledRecords, ...],
    fields: list[str] | None,
    refs: list[_Ref] | None,
    /,
) -> tuple[list[_RecordsColumn], list[_Ref]] | None: ...

@final
class PickledRecords:
    """Records start..stop of a pickled batch, read where they lie (scan_pickled)."""
    @property
    def frame(self) -> bytes: ...
    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...
    @property
    def fields(self) -> int | None: ...
    def __len__(self) -> int: ...
    def slice(self, start: int, stop: int, /) -> PickledRecords: ...

def scan_pickled(frame: bytes, /) -> PickledRecords | None: ...

# ---------------------------------------------------------------- rendezvous

# A node's row: {index: int, host: str, executor_id: str, pid: int,
# ports: list[int], role: str, task_index: int}.  A dict rather than a
# TypedDict: the Python layer passes rows on as Dict[str, Any].
_Node: TypeAlias = dict[str, Any]

@final
class ClusterSpec:
    # not constructible from Python: RendezvousClient.wait_spec makes it
    def __len__(self) -> int: ...
    def __getitem__(self, index: SupportsIndex, /) -> _Node: ...
    def tolist(self) -> list[_Node]: ...

_EventKind: TypeAlias = Literal[
    "registered", "ready", "progress", "done", "failed", "lost", "rejected", "unknown"
]

@final
class RendezvousServer:
    def __new__(
        cls,
        secret: ReadableBuffer,
        num_nodes: int,
        *,
        num_ps: int = 0,
        chief: bool = False,
        evaluator: bool = False,
        host: str = "",
        port: int = 0,
        heartbeat_timeout_ms: int = 10000,
        handshake_timeout_ms: int = 10000,
    ) -> Self: ...
    @property
    def port(self) -> int: ...
    def wait_ready(self, timeout_s: float, /) -> None: ...
    # (kind, node or -1, code, text or None); None when timeout_s passed
    def next_event(self, timeout_s: float, /) -> tuple[_EventKind, int, int, str | None] | None: ...
    def nodes(self) -> list[_Node]: ...
    def stop(self, node: int = -1, grace_ms: int = 0) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> Literal[False]: ...

@final
class RendezvousClient:
    def __new__(cls, host: str, port: int, secret: ReadableBuffer, timeout_s: float) -> Self: ...
    def register(
        self, index: int, host: str, executor_id: str, pid: int, ports: Sequence[int],
        timeout_s: float,
    ) -> None: ...
    # (the node table, this node's position in it)
    def wait_spec(self, timeout_s: float, /) -> tuple[ClusterSpec, int]: ...
    def start(self, interval_ms: int = 1000, exit_on_loss: bool = True,
              silence_ms: int = 0) -> None: ...
    def stop_state(self) -> int: ...
    # kind: 'progress', 'done' or 'failed' (ValueError otherwise)
    def report(self, kind: str, code: int, text: str, timeout_s: float = 10.0) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> Literal[False]: ...

# ---------------------------------------------------------------- feed

@final
class FeedItem:
    # not constructible from Python: FeedServer.next and
    # FeedClient.recv_results make it.  Its buffer is the encoded batch
    # (read-only bytes); columns locate each column in it.
    @property
    def kind(
        self,
    ) -> Literal["batch", "end", "results", "error", "start", "partition_end", "call_end"]: ...
    @property
    def call(self) -> int: ...
    @property
    def tag(self) -> bytes | None: ...  # 'start' items only
    @property
    def reason(self) -> str | None: ...  # 'error' items only
    @property
    def source(self) -> int: ...
    @property
    def partition(self) -> int: ...
    @property
    def flags(self) -> int: ...
    @property
    def nrows(self) -> int: ...
    @property
    def columns(self) -> list[_DecodedColumn]: ...
    def release(self) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class FeedServer:
    def __new__(
        cls,
        secret: ReadableBuffer,
        *,
        listen_fd: int = -1,
        host: str = "",
        port: int = 0,
        queue_bytes: int = 0,
        max_frame: int = 0,
        io_timeout_ms: int = 0,
        shm: bool = True,
        encrypt: bool = False,
    ) -> Self: ...
    @property
    def port(self) -> int: ...
    def next(self, timeout_s: float, /) -> FeedItem | None: ...
    def send_results(
        self, source: int, columns: Sequence[_ColumnSpec], nrows: int, timeout_s: float
    ) -> None: ...
    def terminate(self) -> None: ...
    # batches_received, records_received, bytes_received, partitions_acked,
    # duplicate_partitions, producers_rejected, shm_producers
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> Literal[False]: ...

# the address of libember's ember_feed_reader_api table (feed_reader.h)
FEED_READER_API: int
# the address of libember's ember_comm_api table (collective.h)
COLLECTIVE_API: int

@final
class FeedReader:
    def __new__(cls, server: FeedServer, *, fail_on_producer_error: bool = False) -> Self: ...
    @property
    def id(self) -> int: ...
    def wait(self, batch_rows: int, timeout_s: float, /) -> int | None: ...
    def layout(self) -> list[tuple[str, int, int]]: ...
    # rows, batches, calls_ended, producer_errors
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...

@final
class FeedClient:
    def __new__(
        cls,
        host: str,
        port: int,
        secret: ReadableBuffer,
        partition: int,
        *,
        want_results: bool = False,
        timeout_s: float = 60.0,
        shm: bool | None = None,
        shm_bytes: int = 0,
        resume: bool = False,
        call: int = 0,
        call_partitions: int = 0,
        tag: ReadableBuffer = b"",
        encrypt: bool = False,
    ) -> Self: ...
    @property
    def resume_point(self) -> tuple[int, bool]: ...
    @property
    def in_place_max(self) -> int: ...
    @property
    def uses_shm(self) -> bool: ...
    def send(self, columns: Sequence[_ColumnSpec], nrows: int, timeout_s: float) -> None: ...
    # (refs for the next chunk, bytes of the columns), or None: nothing sent
    def send_records(
        self,
        records: list[Any] | PickledRecords | tuple[PickledRecords, ...],
        fields: list[str] | None,
        refs: list[_Ref] | None,
        timeout_s: float,
    ) -> tuple[list[_Ref], int] | None: ...
    def recv_results(self, timeout_s: float, /) -> FeedItem: ...
    def end_partition(self, timeout_s: float, /) -> None: ...
    def end_partition_send(self, timeout_s: float, /) -> None: ...
    def end_partition_wait(self, timeout_s: float, /) -> None: ...
    def end_feed(self, timeout_s: float, /) -> None: ...
    def fail(self, reason: str, timeout_s: float, /) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> Literal[False]: ...

# ---------------------------------------------------------------- collectives

@final
class Communicator:
    def __new__(
        cls,
        rank: int,
        addresses: Sequence[str],
        secret: ReadableBuffer,
        timeout: float = 60.0,
        *,
        listen_fd: int = -1,
        bind_host: str | None = None,
        tcp_only: bool = False,
        small_max: int = 0,
        encrypt: bool = False,
    ) -> Self: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def timeout(self) -> float: ...
    @property
    def id(self) -> int: ...
    # op: 'sum', 'avg' (or 'mean'), 'min', 'max'; timeout None: the
    # communicator's.  Each returns its (in-place) buffer argument.
    def allreduce(self, buf: _W, op: str = "sum", timeout: float | None = None) -> _W: ...
    def broadcast(self, buf: _W, root: int = 0, timeout: float | None = None) -> _W: ...
    def allgather(self, send: _Readable | None, recv: _W, timeout: float | None = None) -> _W: ...
    def barrier(self, timeout: float | None = None) -> None: ...
    def transport(self, peer: int, /) -> Literal["self", "shm", "tcp"]: ...
    def algorithm(self, buf: _Readable, /) -> str: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> Literal[False]: ...

# ---------------------------------------------------------------- parameter server

PS_ASYNC: Final = 4294967295  # PsServer staleness: never wait (what None means)
PS_NAME_MAX: Final = 128  # bytes of a table name, NUL included
PS_MAX_SHARDS: Final = 1024
PS_MAX_COLS: Final = 1048576

# Row ids: a C-contiguous buffer of uint64 or int64 (a numpy array) or a
# sequence of ints; None (where allowed) is every row of a dense table.
_RowIds: TypeAlias = _Readable | Sequence[int]

# layout 'dense' or 'sparse' (ValueError otherwise)
def ps_shard_of_row(layout: str, rows: int, row: int, num_shards: int, /) -> int: ...

@final
class PsServer:
    def __new__(
        cls,
        secret: ReadableBuffer,
        shard: int,
        num_shards: int,
        num_workers: int,
        *,
        staleness: int | None = None,
        host: str = "",
        port: int = 0,
        listen_fd: int = -1,
        encrypt: bool = False,
        shm: bool = True,
    ) -> Self: ...
    @property
    def port(self) -> int: ...
    # tables, rows_held, pulls, pushes, rows_pulled, rows_pushed,
    # bytes_received, bytes_sent, requests_refused, stale_waits, min_clock,
    # workers_connected, shm_connections
    def stats(self) -> dict[str, int]: ...
    def save(self, dir: StrOrBytesPath, /) -> None: ...
    def restore(self, dir: StrOrBytesPath, /) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> Literal[False]: ...

@final
class PsClient:
    def __new__(
        cls,
        hosts: Sequence[str],
        ports: Sequence[int],
        secret: ReadableBuffer,
        worker: int,
        num_workers: int,
        *,
        timeout_s: float = 600.0,
        encrypt: bool = False,
        shm: bool | None = None,
        shm_bytes: int = 0,
    ) -> Self: ...
    @property
    def worker(self) -> int: ...
    @property
    def num_workers(self) -> int: ...
    @property
    def num_shards(self) -> int: ...
    # by shard: shared memory (a shard on this host) or TCP
    @property
    def transports(self) -> list[Literal["shm", "tcp"]]: ...
    # layout 'dense' or 'sparse'; optimizer 'sgd', 'momentum', 'adagrad' or
    # 'adam'; init 'zeros', 'uniform' or 'normal' (ValueError otherwise)
    def declare(
        self,
        name: str,
        layout: str,
        rows: int,
        cols: int,
        optimizer: str,
        learning_rate: float,
        *,
        momentum: float = 0.0,
        beta1: float = 0.0,
        beta2: float = 0.0,
        epsilon: float = 0.0,
        initial_accumulator: float = 0.0,
        init: str = "zeros",
        init_scale: float = 0.0,
        seed: int = 0,
    ) -> None: ...
    # a new (len(ids), cols) float32 array, or out filled in place
    @overload
    def pull(
        self, table: str, ids: _RowIds | None, cols: int, out: None = None
    ) -> NDArray[np.float32]: ...
    @overload
    def pull(self, table: str, ids: _RowIds | None, cols: int, out: _W) -> _W: ...
    def push(self, table: str, ids: _RowIds | None, rows: _Readable) -> None: ...
    def assign(self, table: str, ids: _RowIds | None, rows: _Readable) -> None: ...
    def initialize(self, table: str, ids: _RowIds | None, rows: _Readable) -> None: ...
    def clock(self) -> None: ...
    def finish(self) -> None: ...
    def save(self, dir: StrOrBytesPath, /) -> None: ...
    def bytes(self, shard: int | None = None) -> tuple[int, int]: ...  # (sent, received)
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> Literal[False]: ...

# ---------------------------------------------------------------- HDFS (WebHDFS)
# Every function and HdfsFile take the keyword-only options namenode, user,
# conf_dir, timeout (seconds), range_bytes (0: 8 MiB) and retries (-1: 4).

# {name: str ('' for hdfs_stat, and for a file listed by hdfs_list),
# type: 'FILE' or 'DIRECTORY', length: int, modification_time: int (ms since
# the epoch), permission: int, replication: int, block_size: int, owner: str,
# group: str}; a dict, as ember.hdfs.stat returns it.
_HdfsStatus: TypeAlias = dict[str, Any]

def hdfs_stat(
    url: str, *, namenode: str | None = None, user: str | None = None,
    conf_dir: str | None = None, timeout: float = 60.0, range_bytes: int = 0, retries: int = -1,
) -> _HdfsStatus: ...
def hdfs_list(
    url: str, *, namenode: str | None = None, user: str | None = None,
    conf_dir: str | None = None, timeout: float = 60.0, range_bytes: int = 0, retries: int = -1,
) -> list[_HdfsStatus]: ...
def hdfs_read(
    url: str, offset: int = 0, length: int = -1, *, namenode: str | None = None,
    user: str | None = None, conf_dir: str | None = None, timeout: float = 60.0,
    range_bytes: int = 0, retries: int = -1,
) -> bytes: ...
def hdfs_write(
    url: str, data: ReadableBuffer, *, overwrite: bool = True, namenode: str | None = None,
    user: str | None = None, conf_dir: str | None = None, timeout: float = 60.0,
    range_bytes: int = 0, retries: int = -1,
) -> None: ...
def hdfs_mkdirs(
    url: str, *, namenode: str | None = None, user: str | None = None,
    conf_dir: str | None = None, timeout: float = 60.0, range_bytes: int = 0, retries: int = -1,
) -> None: ...
def hdfs_set_permission(
    url: str, mode: int, *, namenode: str | None = None, user: str | None = None,
    conf_dir: str | None = None, timeout: float = 60.0, range_bytes: int = 0, retries: int = -1,
) -> None: ...
def hdfs_delegation_token(
    url: str, renewer: str, *, namenode: str | None = None, user: str | None = None,
    conf_dir: str | None = None, timeout: float = 60.0, range_bytes: int = 0, retries: int = -1,
) -> str: ...
def spnego_header(host: str, what: str | None = None) -> str: ...
def kerberos_principal() -> str: ...
def hdfs_delete(
    url: str, recursive: bool = False, *, namenode: str | None = None, user: str | None = None,
    conf_dir: str | None = None, timeout: float = 60.0, range_bytes: int = 0, retries: int = -1,
) -> bool: ...
def hdfs_rename(
    src: str, dst: str, overwrite: bool = False, *, namenode: str | None = None,
    user: str | None = None, conf_dir: str | None = None, timeout: float = 60.0,
    range_bytes: int = 0, retries: int = -1,
) -> None: ...

@final
class HdfsFile:
    def __new__(
        cls, url: str, *, namenode: str | None = None, user: str | None = None,
        conf_dir: str | None = None, timeout: float = 60.0, range_bytes: int = 0,
        retries: int = -1,
    ) -> Self: ...
    @property
    def size(self) -> int: ...
    @property
    def url(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def stats(self) -> dict[str, int]: ...  # requests, ranges, retries, bytes
    def read(self, n: int = -1, /) -> bytes: ...
    def readinto(self, buffer: _Writable, /) -> int: ...
    def seek(self, offset: int, whence: int = 0, /) -> int: ...
    def tell(self) -> int: ...
    def readable(self) -> bool: ...
    def seekable(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> None: ...

# ---------------------------------------------------------------- TFRecord and Example

@final
class Buffer:
    # not constructible from Python: ExampleDecoder.take makes it.  Memory
    # owned by Ember, exported with a typed format (numpy.asarray views it).
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

# (values, value_offsets or None, row_offsets or None, present)
_DecoderColumn: TypeAlias = tuple[Buffer, Buffer | None, Buffer | None, Buffer]

@final
class ExampleDecoder:
    # specs: (name, kind, width=0, flags=0) per column; kind EX_*, flags
    # EX_OPTIONAL or 0
    def __new__(
        cls,
        specs: Sequence[tuple[str, int] | tuple[str, int, int] | tuple[str, int, int, int]],
    ) -> Self: ...
    @property
    def rows(self) -> int: ...
    def add(self, example: ReadableBuffer, /) -> None: ...
    def take(self) -> tuple[int, list[_DecoderColumn]]: ...
    # rows: a contiguous int64 buffer of row indices; the decoder keeps its rows
    def gather(self, rows: _Readable, /) -> tuple[int, list[_DecoderColumn]]: ...
    def clear(self) -> None: ...
    def close(self) -> None: ...

@final
class TFRecordReader:
    # source: a path or hdfs:// / webhdfs:// URL (str or os.PathLike), or a
    # bytes-like buffer of records (name names it in errors)
    def __new__(
        cls,
        source: str | os.PathLike[str] | os.PathLike[bytes] | ReadableBuffer,
        *,
        name: str | None = None,
        compression: int = 0,
        check_crc: bool = True,
        skip_corrupt: bool = False,
        max_record: int = 0,
    ) -> Self: ...
    # records, data_bytes, stream_bytes, skipped, skipped_bytes, last_offset
    @property
    def stats(self) -> dict[str, int]: ...
    def next(self) -> bytes | None: ...
    def read_examples(
        self, decoder: ExampleDecoder, n: int, every: int = 1, phase: int = 0, /
    ) -> int: ...
    def close(self) -> None: ...
    def __iter__(self) -> Self: ...
    def __next__(self) -> bytes: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> None: ...

# (name, kind, width, values, value_offsets, row_offsets, present): kind EX_*;
# value_offsets for bytes columns, row_offsets for width 0, present None or
# one uint8 per row
_ExampleColumn: TypeAlias = tuple[
    str, int, int, _Readable, _Readable | None, _Readable | None, _Readable | None
]

@final
class TFRecordWriter:
    # path None: into memory (getvalue); an hdfs:// or webhdfs:// URL is
    # streamed over WebHDFS.  builtins.bytes: "bytes" is a property here
    def __new__(
        cls,
        path: str | builtins.bytes | os.PathLike[str] | os.PathLike[builtins.bytes] | None,
        compression: int = 0,
        level: int = -1,
    ) -> Self: ...
    @property
    def records(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    def write(self, record: ReadableBuffer, /) -> None: ...
    def write_examples(self, columns: Sequence[_ExampleColumn], nrows: int, /) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def getvalue(self) -> builtins.bytes: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> None: ...

def crc32c(data: ReadableBuffer, value: int = 0, /) -> int: ...
def masked_crc32c(data: ReadableBuffer, /) -> int: ...
def crc32c_hw() -> bool: ...

# {name: (kind, values)}: kind 0 none, EX_BYTES (values: list of bytes),
# EX_FLOAT (float32 little-endian bytes) or EX_INT64 (int64 little-endian bytes).
# values is Any: its type follows kind, which a checker cannot correlate.
def example_parse(data: ReadableBuffer, /) -> dict[str, tuple[int, Any]]: ...
def encode_examples(columns: Sequence[_ExampleColumn], nrows: int, /) -> list[bytes]: ...
