"""Where a model's files are on this host: the one place that turns an
ExportDir or ModelDir, local or ``hdfs://`` / ``webhdfs://``, into a local
path that TensorFlow or torch can open, with the model version's stamp.

TensorFlow (2.20, 2.21) has no ``hdfs://`` file system here (no libhdfs), so a model
on HDFS is copied by :mod:`ember.hdfs` into a per-host cache,
``<tempdir>/ember-models-<uid>/<hash of the URL>/<hash of the version>/``
(``EMBER_MODEL_CACHE`` moves the root).  The version is what identifies the
model on HDFS: saved_model.pb's modification time and length for a
SavedModel, the archive's for TorchScript, and the checkpoint the
'checkpoint' state file names plus its files' times and lengths for a
ModelDir.  So:

- a second load of the same version, by any process on the host (the
  driver, Python workers, direct-path workers), downloads nothing;
- a model rewritten on HDFS is a new version, copied afresh;
- concurrent processes each download into a private temporary directory and
  ``os.rename`` it into place; a loser of that race removes its copy and
  uses the winner's, so nobody ever reads a partial copy.

A version not used for :data:`KEEP_UNUSED_S` is removed when a newer one of
the same URL is copied in (a use touches its directory).  Local paths (and
``file://`` URLs) are used in place.  Nothing here imports TensorFlow,
torch or pyspark.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import posixpath
import re
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from ember import hdfs
from ember.errors import EmberError, ModelInputError, in_context

logger = logging.getLogger("ember.ml")

V = TypeVar("V")  # what identifies a model's version on HDFS

#: The environment variable that moves the cache root.
CACHE_ENV = "EMBER_MODEL_CACHE"
#: Seconds a cached version may go unused before a newer version of its URL
#: replaces it (long enough for any process still loading it).
KEEP_UNUSED_S = 600.0
#: Downloads retried when the model changed on HDFS while it was being copied.
_TRIES = 3
#: The file a SavedModel directory always holds.
SAVED_MODEL_PB = "saved_model.pb"


def is_remote(path: Optional[str]) -> bool:
    """Whether ``path`` is on HDFS (``hdfs://``, ``webhdfs://``, ``swebhdfs://``)."""
    return hdfs.is_hdfs(path)


def local_path(path: str) -> str:
    """A local path or ``file://`` URL as a path."""
    return path[len("file://"):] if path.startswith("file://") else path


def isfile(path: str) -> bool:
    """Whether ``path`` (local or on HDFS) is a file; False when it is missing."""
    if not is_remote(path):
        return os.path.isfile(local_path(path))
    st = _stat(path, "ExportDir")
    return st is not None and st["type"] == "FILE"


# --------------------------------------------------------------------------- HDFS calls

def _hdfs_call(what: str, url: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; a failure other than a missing path becomes an error that
    names ``what`` (ExportDir, ModelDir), its URL, and the configuration the
    driver and the executors need (the C client's message follows)."""
    try:
        return fn(*args)
    except (FileNotFoundError, PermissionError):
        raise
    except EmberError as exc:
        raise in_context(exc, f"{what} {url!r}: cannot read it from HDFS (set HADOOP_CONF_DIR "
                              "to the cluster's client configuration on the driver and, through "
                              "spark.executorEnv.HADOOP_CONF_DIR, on the executors, and check "
                              "that the NameNode is up)") from exc


def _stat(url: str, what: str, of: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """GETFILESTATUS of ``url``, None when it is missing."""
    try:
        return _hdfs_call(what, of or url, hdfs.stat, url)
    except FileNotFoundError:
        return None


def _list(url: str, what: str, of: str) -> List[Dict[str, Any]]:
    return _hdfs_call(what, of, hdfs.list_status, url)


# --------------------------------------------------------------------------- the cache

def cache_root() -> str:
    """This user's model cache on this host (created private to the user)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(),
                                                     f"ember-models-{os.getuid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    if os.stat(root).st_uid != os.getuid():  # models are code: never load another user's
        raise PermissionError(f"model cache {root} belongs to another user; set {CACHE_ENV} "
                              "to a directory of your own")
    return root


def _digest(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


def cache_dir(url: str) -> str:
    """The directory of ``url``'s cached versions on this host (may not exist)."""
    return os.path.join(cache_root(), _digest(url.rstrip("/")))


def _stamp(url: str, version: Any) -> int:
    """The model's stamp in the inference spec: an int that changes with the
    version on HDFS (the same on every host)."""
    return int(_digest(url, version)[:15], 16)


def _cached(url: str, version: Callable[[], V], fill: Callable[[str, V], None]) -> Tuple[str, V]:
    """(the local directory holding the current version of ``url``, that
    version).  The cached copy if there is one; else ``fill(tmp, version)``
    copies it into a fresh temporary directory that is renamed into place.
    The version is read again after the copy: when the model changed on HDFS
    meanwhile (or a file vanished, as when an upload replaces it), the copy,
    perhaps of two versions, is dropped and the new version copied, up to
    :data:`_TRIES` times."""
    v = version()  # first: a missing model leaves nothing behind
    base = cache_dir(url)
    os.makedirs(base, mode=0o700, exist_ok=True)
    for _ in range(_TRIES):
        final = os.path.join(base, _digest(v))
        if os.path.isdir(final):
            os.utime(final)  # in use: a newer version's copy keeps it for KEEP_UNUSED_S
            return final, v
        tmp = os.path.join(base, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp, mode=0o700)
        started = time.monotonic()
        try:
            try:
                fill(tmp, v)
                torn = False
            except FileNotFoundError:
                torn = True
            now = version()  # raises when the model is gone altogether
            if not torn and now == v:
                try:
                    os.rename(tmp, final)
                except OSError:  # another process renamed its copy first: use that one
                    if not os.path.isdir(final):
                        raise
                    logger.debug(f"{url}: another process cached it first")
                else:
                    logger.info(f"copied {url} to {final} in {time.monotonic() - started:.1f} s")
                    _prune(base, final)
                os.utime(final)
                return final, v
            logger.info(f"{url} changed on HDFS while it was copied; copying it again")
            v = now
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise ModelInputError(f"{url} changed on HDFS during each of {_TRIES} copies; retry once "
                          "it is written")


def _prune(base: str, keep: str) -> None:
    """Removes the other versions of ``base``'s URL not used for KEEP_UNUSED_S
    (and temporary copies of crashed processes as old)."""
    old = time.time() - KEEP_UNUSED_S
    for name in os.listdir(base):
        path = os.path.join(base, name)
        try:
            if path != keep and os.stat(path).st_mtime < old:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


# --------------------------------------------------------------------------- models

def saved_model(export_dir: str) -> Tuple[str, int]:
    """(a local directory holding the SavedModel ``export_dir``, its stamp:
    saved_model.pb's modification time in ns for a local one, a hash of the
    URL and the version for one on HDFS).  Raises ModelInputError naming
    ``export_dir`` when it holds no saved_model.pb."""
    missing = f"ExportDir {export_dir!r} holds no SavedModel (no {SAVED_MODEL_PB} there)"
    if not is_remote(export_dir):
        path = local_path(export_dir)
        try:
            return path, os.stat(os.path.join(path, SAVED_MODEL_PB)).st_mtime_ns
        except (FileNotFoundError, NotADirectoryError):
            raise ModelInputError(missing) from None
    url = export_dir.rstrip("/")
    pb = hdfs.join(url, SAVED_MODEL_PB)

    def version() -> Tuple[int, int]:
        st = _stat(pb, "ExportDir", url)
        if st is None:
            raise ModelInputError(missing)
        return int(st["modification_time"]), int(st["length"])

    def fill(tmp: str, _v: Tuple[int, int]) -> None:
        for e in _list(url, "ExportDir", url):
            _download(url, hdfs.join(url, e["name"]), os.path.join(tmp, e["name"]))

    path, v = _cached(url, version, fill)
    return path, _stamp(url, v)


def _download(of: str, url: str, local: str) -> None:
    _hdfs_call("ExportDir", of, hdfs.download, url, local)


def model_file(path: str) -> Tuple[str, int]:
    """(a local copy of the file ``path``, its stamp: its modification time in ns
    for a local one, as :func:`saved_model` on HDFS).  A local path is used in
    place; FileNotFoundError when it is missing."""
    if not is_remote(path):
        p = local_path(path)
        return p, os.stat(p).st_mtime_ns
    url = path.rstrip("/")
    name = posixpath.basename(hdfs._split(url)[1]) or "model"

    def version() -> Tuple[int, int]:
        st = _stat(url, "ExportDir")
        if st is None or st["type"] != "FILE":
            raise FileNotFoundError(f"no such file on HDFS: {url}")
        return int(st["modification_time"]), int(st["length"])

    d, v = _cached(url, version, lambda tmp, _v: _download(url, url, os.path.join(tmp, name)))
    return os.path.join(d, name), _stamp(url, v)


# --------------------------------------------------------------------------- TF1 checkpoints

#: ``model_checkpoint_path: "..."`` in a CheckpointState text proto.
_STATE_RE = re.compile(r'^\s*model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"', re.M)

#: (directory URL, checkpoint prefix's base name, its files' (name, mtime, length))
_Checkpoint = Tuple[str, str, Tuple[Tuple[str, int, int], ...]]


def no_checkpoint(model_dir: str) -> ModelInputError:
    """The error of a ModelDir whose 'checkpoint' file names no checkpoint."""
    return ModelInputError(f"ModelDir {model_dir!r} holds no checkpoint (no 'checkpoint' "
                           "index file naming one)")


def _state_path(text: str) -> Optional[str]:
    """The checkpoint a 'checkpoint' state file names (text-format escapes undone)."""
    m = _STATE_RE.search(text)
    if not m:
        return None
    raw = m.group(1)
    try:
        return ast.literal_eval('b"' + raw + '"').decode("utf-8")
    except (ValueError, SyntaxError, UnicodeDecodeError):
        return raw


def checkpoint_dir(model_dir: str) -> Tuple[str, Optional[int]]:
    """(a local directory whose 'checkpoint' file names the latest checkpoint of
    ``model_dir``, that checkpoint's stamp when ``model_dir`` is on HDFS, else
    None).  A local ModelDir is used in place.

    From HDFS only that checkpoint is copied: the files ``<prefix>.*`` beside
    the prefix the state file names (``.meta``, ``.index``, ``.data-*``),
    with a fresh state file naming it by base name.  A prefix written as an
    absolute local path (TF1's Saver on a node that then uploaded its
    directory) is looked up by base name in ModelDir."""
    if not is_remote(model_dir):
        return local_path(model_dir), None
    url = model_dir.rstrip("/")

    def version() -> _Checkpoint:
        try:
            text = _hdfs_call("ModelDir", url, hdfs.read_bytes, hdfs.join(url, "checkpoint"))
        except FileNotFoundError:
            raise no_checkpoint(url) from None
        named = _state_path(text.decode("utf-8", "replace"))
        if not named:
            raise no_checkpoint(url)
        if "://" in named:
            prefix = named
        elif named.startswith("/"):
            prefix = hdfs.join(url, posixpath.basename(named))
        else:
            prefix = hdfs.join(url, named)
        parent, base = prefix.rsplit("/", 1)
        try:
            entries = _list(parent, "ModelDir", url)
        except FileNotFoundError:
            entries = []
        files = tuple(sorted((e["name"], int(e["modification_time"]), int(e["length"]))
                             for e in entries if e["type"] == "FILE"
                             and e["name"].startswith(base + ".")))
        if not files:
            raise ModelInputError(f"ModelDir {url!r}: its 'checkpoint' file names {named!r}, "
                                  f"but {parent} holds no {base}.* files")
        return parent, base, files

    def fill(tmp: str, v: _Checkpoint) -> None:
        parent, base, files = v
        for name, _t, _n in files:
            _hdfs_call("ModelDir", url, hdfs.download, hdfs.join(parent, name),
                       os.path.join(tmp, name))
        quoted = base.replace("\\", "\\\\").replace('"', '\\"')
        with open(os.path.join(tmp, "checkpoint"), "w") as f:
            f.write(f'model_checkpoint_path: "{quoted}"\nall_model_checkpoint_paths: "{quoted}"\n')

    path, v = _cached(url, version, fill)
    return path, _stamp(url, v)
