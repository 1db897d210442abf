"""HDFS paths for Ember, over WebHDFS (libember's C client: no JVM, no libhdfs,
no CLASSPATH).

The 5-line version::

    from ember import hdfs
    hdfs.write_bytes("hdfs:///user/me/x.bin", b"...")     # NameNode from HADOOP_CONF_DIR
    hdfs.listdir("hdfs:///user/me")                       # ['x.bin']
    hdfs.upload("/tmp/export", "hdfs:///user/me/export")  # a directory, replaced atomically-ish
    hdfs.download("hdfs:///user/me/export", "/tmp/copy")

URLs are ``hdfs://host:port/path`` (the NameNode's RPC address, as in
Hadoop; its HTTP address is found in ``$HADOOP_CONF_DIR``'s hdfs-site.xml),
``hdfs:///path`` (fs.defaultFS), or ``webhdfs://host:http_port/path``.
Missing paths raise :class:`EmberFileNotFoundError` (a ``FileNotFoundError``),
refused ones :class:`EmberPermissionError` (a ``PermissionError``), both
naming the path.

TensorFlow and HDFS.  TensorFlow (2.20, 2.21) has no ``hdfs://`` file system of its
own unless libhdfs and a Hadoop CLASSPATH are installed (its HDFS plugin
loads libhdfs.so through JNI), which is exactly the set-up Ember avoids.  So
checkpoints, SavedModels and TensorBoard logs are written to a local
directory and copied to HDFS by :func:`upload` (or kept in step with
:class:`Mirror`), and read back with :func:`download`.  ``ember.tfrecord``
reads and writes ``hdfs://`` TFRecords directly.
"""

from __future__ import annotations

import builtins
import contextlib
import fnmatch
import mmap
import os
import posixpath
import shutil
import tempfile
import uuid
import xml.etree.ElementTree as ET
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ember import _ember

EmberFileNotFoundError = _ember.EmberFileNotFoundError
EmberPermissionError = _ember.EmberPermissionError
HdfsFile = _ember.HdfsFile

SCHEMES = ("hdfs://", "webhdfs://", "swebhdfs://")

__all__ = ["is_hdfs", "default_fs", "qualify", "stat", "exists", "isdir", "isfile",
           "listdir", "list_status", "glob", "makedirs", "delete", "rename", "read_bytes",
           "write_bytes", "open", "upload", "download", "Mirror", "ensure_conf_dir",
           "EmberFileNotFoundError", "EmberPermissionError", "HdfsFile"]


def is_hdfs(path: Any) -> bool:
    """Whether ``path`` is an HDFS URL (``hdfs://``, ``webhdfs://``, ``swebhdfs://``)."""
    return isinstance(path, str) and path.startswith(SCHEMES)


def _conf_props(path: str) -> Dict[str, str]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    out: Dict[str, str] = {}
    for p in root.iter("property"):
        name, value = p.findtext("name"), p.findtext("value")
        if name is not None and value is not None:
            out[name.strip()] = value.strip()
    return out


def default_fs(conf_dir: Optional[str] = None) -> str:
    """``fs.defaultFS`` from ``core-site.xml`` in ``conf_dir`` (default
    ``$HADOOP_CONF_DIR``), without a trailing slash; ``"file://"`` when there
    is no configuration (Hadoop's own default)."""
    d = conf_dir or os.environ.get("HADOOP_CONF_DIR")
    if d:
        fs = _conf_props(os.path.join(d, "core-site.xml")).get("fs.defaultFS")
        if fs:
            return fs.rstrip("/") if fs.rstrip("/") not in ("file:", "") else "file://"
    return "file://"


def qualify(path: str, working_dir: Optional[str] = None, user: Optional[str] = None,
            conf_dir: Optional[str] = None) -> str:
    """A fully qualified URI for ``path`` (TensorFlowOnSpark's ``hdfs_path`` rules):
    a URI passes through; with an ``hdfs://`` (or ``viewfs://``) default file
    system an absolute path goes under it and a relative one under the user's
    home ``/user/<user>``; with a local one, paths are resolved against
    ``working_dir`` and get ``file://``."""
    if "://" in path:
        return path
    fs = default_fs(conf_dir)
    if fs.startswith(("hdfs://", "viewfs://", "webhdfs://", "swebhdfs://")):
        if path.startswith("/"):
            return fs + path
        who = user or os.environ.get("HADOOP_USER_NAME") or _login_name()
        return f"{fs}/user/{who}/{path}"
    return "file://" + os.path.abspath(os.path.join(working_dir or os.getcwd(), path))


def _login_name() -> str:
    import getpass
    return getpass.getuser()


@contextlib.contextmanager
def errors() -> Iterator[None]:
    """Re-raises an :class:`EmberError` of a missing path / refused access
    from calls that map codes generically (the TFRecord reader and writer) as
    :class:`EmberFileNotFoundError` / :class:`EmberPermissionError`."""
    try:
        yield
    except (EmberFileNotFoundError, EmberPermissionError):
        raise
    except _ember.EmberError as e:
        code = getattr(e, "code", None)
        for cls in (EmberFileNotFoundError, EmberPermissionError):
            if code == cls.code:
                raise cls(str(e)) from None
        raise


def ensure_conf_dir(conf_dir: Optional[str]) -> None:
    """Sets ``HADOOP_CONF_DIR`` to ``conf_dir`` in this process when it is unset
    and the directory exists here (how Spark tasks get the driver's Hadoop
    configuration when their executor was started without one)."""
    if conf_dir and not os.environ.get("HADOOP_CONF_DIR") and os.path.isdir(conf_dir):
        os.environ["HADOOP_CONF_DIR"] = conf_dir


# ---------------------------------------------------------------- metadata

def stat(url: str) -> Dict[str, Any]:
    """GETFILESTATUS: ``{"type": "FILE"|"DIRECTORY", "length", ...}``."""
    return _ember.hdfs_stat(url)


def exists(url: str) -> bool:
    try:
        _ember.hdfs_stat(url)
        return True
    except FileNotFoundError:
        return False


def isdir(url: str) -> bool:
    try:
        return _ember.hdfs_stat(url)["type"] == "DIRECTORY"
    except FileNotFoundError:
        return False


def isfile(url: str) -> bool:
    try:
        return _ember.hdfs_stat(url)["type"] == "FILE"
    except FileNotFoundError:
        return False


def list_status(url: str) -> List[Dict[str, Any]]:
    """LISTSTATUS of a directory (sorted by name; a file lists as itself with name '')."""
    return _ember.hdfs_list(url)


def listdir(url: str) -> List[str]:
    """Names in a directory, sorted."""
    return [e["name"] for e in _ember.hdfs_list(url) if e["name"]]


def join(url: str, *parts: str) -> str:
    """``posixpath.join`` for URLs."""
    scheme, rest = _split(url)
    return scheme + posixpath.join(rest, *parts)


def _split(url: str) -> Tuple[str, str]:
    """("hdfs://authority", "/path")."""
    i = url.index("://") + 3
    j = url.find("/", i)
    return (url, "/") if j < 0 else (url[:j], url[j:])


def glob(pattern: str) -> List[str]:
    """URLs matching ``pattern``, whose wildcards (``* ? [..]``) may be in any
    path component; sorted.  A pattern without wildcards is returned as is
    if it exists."""
    base, path = _split(pattern)
    parts = [p for p in path.split("/") if p]
    found = [base]
    for k, part in enumerate(parts):
        nxt = []
        for prefix in found:
            if not any(c in part for c in "*?["):
                nxt.append(prefix + "/" + part)
                continue
            try:
                names = listdir(prefix + "/" if prefix == base else prefix)
            except (FileNotFoundError, _ember.EmberError):
                continue
            nxt.extend(prefix + "/" + n for n in names if fnmatch.fnmatchcase(n, part))
        found = nxt
    return sorted(u for u in found if exists(u))


def makedirs(url: str) -> None:
    """MKDIRS with parents (existing directories are fine)."""
    _ember.hdfs_mkdirs(url)


def delete(url: str, recursive: bool = False) -> bool:
    """Deletes ``url``; True if something was removed."""
    return _ember.hdfs_delete(url, recursive)


def rename(src: str, dst: str, overwrite: bool = False) -> None:
    """Atomic rename (never *into* a directory; see :func:`ember._ember.hdfs_rename`)."""
    _ember.hdfs_rename(src, dst, overwrite)


# ---------------------------------------------------------------- data

def read_bytes(url: str) -> bytes:
    return _ember.hdfs_read(url)


def write_bytes(url: str, data: Any, overwrite: bool = True) -> None:
    """Writes ``data`` (bytes-like) as the whole file ``url``; parents are created."""
    _ember.hdfs_write(url, data, overwrite=overwrite)


def open(url: str) -> Any:  # noqa: A001  (like io.open, for reading)
    """A read-only, seekable binary file (:class:`ember._ember.HdfsFile`)."""
    return _ember.HdfsFile(url)


def _put_file(local: str, url: str) -> None:
    size = os.path.getsize(local)
    with builtins.open(local, "rb") as f:
        if size == 0:
            _ember.hdfs_write(url, b"", overwrite=True)
            return
        # mapped, not read: the C client streams it in range_bytes chunks
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            _ember.hdfs_write(url, m, overwrite=True)


def upload(local: str, url: str, overwrite: bool = True) -> str:
    """Copies a local file or directory tree to ``url``.

    A directory is first written to a sibling ``<url>._COPYING_<id>`` and then
    renamed into place, so readers never see a partial tree; an existing
    ``url`` is deleted just before that rename (with ``overwrite``), which
    leaves a short window where ``url`` does not exist (HDFS cannot replace a
    non-empty directory atomically).  A single file is written the same way
    and renamed over the old one atomically.  Returns ``url``."""
    local = os.fspath(local)
    if not os.path.exists(local):
        raise FileNotFoundError(f"upload: no such local path {local}")
    tmp = f"{url.rstrip('/')}._COPYING_{uuid.uuid4().hex[:12]}"
    try:
        if os.path.isdir(local):
            makedirs(tmp)
            for root, dirs, files in os.walk(local):
                rel = os.path.relpath(root, local)
                target = tmp if rel == "." else join(tmp, *rel.split(os.sep))
                for d in dirs:
                    makedirs(join(target, d))
                for name in files:
                    _put_file(os.path.join(root, name), join(target, name))
            if exists(url):
                if not overwrite:
                    raise FileExistsError(f"upload: {url} exists (overwrite=False)")
                delete(url, recursive=True)
            rename(tmp, url)
        else:
            _put_file(local, tmp)
            rename(tmp, url, overwrite=overwrite)
    except BaseException:
        try:
            delete(tmp, recursive=True)
        except Exception:
            pass
        raise
    return url


def download(url: str, local: str) -> str:
    """Copies an HDFS file or directory tree to the local path ``local``
    (replacing what is there).  Returns ``local``."""
    st = stat(url)
    if st["type"] == "FILE":
        os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
        tmp = local + ".part"
        with builtins.open(tmp, "wb") as out, _ember.HdfsFile(url) as f:
            shutil.copyfileobj(f, out, 8 << 20)
        os.replace(tmp, local)
        return local
    if os.path.exists(local):
        shutil.rmtree(local)
    os.makedirs(local)
    for e in list_status(url):
        download(join(url, e["name"]), os.path.join(local, e["name"]))
    return local


class Mirror:
    """A local working copy of an HDFS directory, for libraries that only
    write local files (TensorFlow checkpoints, SavedModels, TensorBoard logs
    without libhdfs)::

        with hdfs.Mirror("hdfs:///user/me/model") as m:   # downloads what is there
            manager = tf.train.CheckpointManager(ckpt, m.local, max_to_keep=2)
            ...; manager.save(); m.sync()                   # uploads now
        # on exit (without an exception) uploads once more, then removes m.local

    A local path or ``file://`` URL is used in place: ``local`` is the
    path itself and sync() does nothing."""

    def __init__(self, url: str, download_existing: bool = True,
                 local: Optional[str] = None) -> None:
        self.url = url
        self.remote = is_hdfs(url)
        if not self.remote:
            self.local = url[len("file://"):] if url.startswith("file://") else url
            os.makedirs(self.local, exist_ok=True)
            self._tmp = None
            return
        self._tmp = tempfile.mkdtemp(prefix="ember-hdfs-mirror-")
        self.local = local or os.path.join(self._tmp, "dir")
        if download_existing and isdir(url):
            download(url, self.local)
        else:
            os.makedirs(self.local, exist_ok=True)

    def sync(self) -> None:
        """Uploads the local copy to the URL (a no-op for local paths)."""
        if self.remote:
            upload(self.local, self.url, overwrite=True)

    def close(self, upload_last: bool = True) -> None:
        if self._tmp is not None:
            try:
                if upload_last:
                    self.sync()
            finally:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None

    def __enter__(self) -> "Mirror":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self.close(upload_last=exc_type is None)


def walk_files(url: str) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(url, status) of every file under a directory, depth first, sorted."""
    for e in list_status(url):
        child = join(url, e["name"]) if e["name"] else url
        if e["type"] == "DIRECTORY":
            yield from walk_files(child)
        else:
            yield child, e
