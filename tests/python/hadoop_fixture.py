"""A real Hadoop for tests: HDFS and YARN mini clusters in one JVM on loopback.

``hadoop_cluster`` is a session fixture, started the first time a test asks
for it (never otherwise) and shared by every test after that.  It runs
``org.ember.hadoop.MiniHadoop`` (hadoop/minicluster, built by ``make hadoop``;
the fixture runs that make target itself, a no-op when it is up to date):
a MiniDFSCluster (NameNode + 1 DataNode, WebHDFS on, 1 MiB blocks) and a
MiniYARNCluster (ResourceManager + 1 NodeManager) from Hadoop 3.4.2.  It
yields a :class:`HadoopCluster` with the addresses and a client
configuration directory, and sets nothing global: a test that wants
``HADOOP_CONF_DIR`` takes it from ``cluster.env()`` or sets it with
``monkeypatch``.

The JVM runs until its stdin closes, so it also goes away if pytest is
killed; teardown closes stdin, waits for a clean stop, and removes the
cluster's temporary directory.

``kerberized_hadoop`` is the same HDFS and YARN made a Kerberized grid
(MiniHadoop --secure): a KDC (Hadoop's MiniKdc) in the same JVM, Kerberos on
RPC, SPNEGO on WebHDFS and the ResourceManager's REST API, users with keytabs,
and token files as YARN hands them to containers.  It is a second JVM, started only by the tests of secure
Hadoop; the insecure cluster stays what every other test uses.

Register them in conftest.py with ``from hadoop_fixture import hadoop_cluster``.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Dict, Iterator, List, Optional

import pytest

# Java 17 closes the JDK internals that Hadoop (and its shaded Guice, Jersey,
# protobuf) reach into: the list ember.yarn passes to its ApplicationMaster
from ember.yarn._client import JAVA17_OPENS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_DIR = os.path.join(REPO, "build", "hadoop")

#: Seconds to wait for the READY line (~10 s on 2 cores, ~25 s when they are busy).
#: Environment: EMBER_HADOOP_START_TIMEOUT, EMBER_HADOOP_LOG_LEVEL (default WARN).
START_TIMEOUT_S = float(os.environ.get("EMBER_HADOOP_START_TIMEOUT", "180"))


@dataclasses.dataclass(frozen=True)
class HadoopCluster:
    """Addresses of the running mini clusters.

    Attributes:
        fs: the default file system URI, ``hdfs://127.0.0.1:<rpc port>``.
        webhdfs: the NameNode's HTTP address, ``http://127.0.0.1:<port>``
            (WebHDFS is under ``/webhdfs/v1``).
        rm: the ResourceManager's client RPC address, ``127.0.0.1:<port>``.
        rm_web: the ResourceManager's web address (REST under ``/ws/v1``).
        conf_dir: a ``HADOOP_CONF_DIR`` with core-site.xml, hdfs-site.xml and
            yarn-site.xml for these clusters.
        user: the user the clusters run as (the HDFS superuser).
        root: the cluster's temporary directory (removed at teardown).
        log: the JVM's log file, inside ``root``.
    """

    fs: str
    webhdfs: str
    rm: str
    rm_web: str
    conf_dir: str
    user: str
    root: str
    log: str

    def env(self) -> Dict[str, str]:
        """``os.environ`` plus ``HADOOP_CONF_DIR`` pointing at :attr:`conf_dir`."""
        return dict(os.environ, HADOOP_CONF_DIR=self.conf_dir)

    def hdfs_url(self, path: str) -> str:
        """``hdfs://127.0.0.1:<port>/<path>`` for an absolute HDFS path."""
        if not path.startswith("/"):
            raise ValueError(f"HDFS path must be absolute, not {path!r}")
        return self.fs + path


@dataclasses.dataclass(frozen=True)
class KerberizedHadoop(HadoopCluster):
    """A Kerberized HDFS and YARN (addresses name host ``localhost``, the host
    of their ``HTTP/localhost`` SPNEGO principal) and its realm.

    Attributes:
        realm: ``EXAMPLE.COM``.
        krb5_conf: a krb5.conf for clients (the KDC on TCP, no host name
            canonicalisation).
        principal, keytab: the tests' user (``<user>@EXAMPLE.COM``).
        other_principal, other_keytab: a second user, ``alice``.
        token_file: a Hadoop token file holding the user's HDFS delegation
            token, as YARN gives a container.
        expired_token_file: the same with a token the NameNode holds expired.
    """

    realm: str = ""
    krb5_conf: str = ""
    principal: str = ""
    keytab: str = ""
    other_principal: str = ""
    other_keytab: str = ""
    token_file: str = ""
    expired_token_file: str = ""

    def kinit(self, ccache: str, principal: Optional[str] = None,
              keytab: Optional[str] = None, lifetime: Optional[str] = None) -> None:
        """Fills ``ccache`` (a path) with a ticket from a keytab, as a user's
        ``kinit -kt`` does; ``lifetime`` is kinit's ``-l`` (e.g. ``"2s"``)."""
        cmd = ["kinit", "-c", "FILE:" + ccache]
        if lifetime:
            cmd += ["-l", lifetime]
        cmd += ["-kt", keytab or self.keytab, principal or self.principal]
        subprocess.run(cmd, env=self.client_env(ccache), check=True, timeout=30,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def client_env(self, ccache: str) -> Dict[str, str]:
        """What a client of the grid has set: HADOOP_CONF_DIR, KRB5_CONFIG and
        its ticket cache KRB5CCNAME."""
        return {"HADOOP_CONF_DIR": self.conf_dir, "KRB5_CONFIG": self.krb5_conf,
                "KRB5CCNAME": "FILE:" + ccache}

    def env(self) -> Dict[str, str]:
        """``os.environ`` plus HADOOP_CONF_DIR and KRB5_CONFIG (no ticket cache)."""
        return dict(os.environ, HADOOP_CONF_DIR=self.conf_dir, KRB5_CONFIG=self.krb5_conf)


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    java = shutil.which("java")
    if java is None:
        raise RuntimeError("java not found (Java 17 is needed for the test Hadoop)")
    return java


def _build() -> List[str]:
    """Runs ``make hadoop`` (a no-op when up to date); returns the classpath."""
    r = subprocess.run(["make", "--no-print-directory", "-s", "hadoop"], cwd=REPO,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`make hadoop` failed (exit {r.returncode}):\n{r.stdout[-4000:]}")
    with open(os.path.join(BUILD_DIR, "classpath.txt")) as f:
        deps = f.read().strip()
    return [os.path.join(BUILD_DIR, "ember-minicluster.jar")] + deps.split(os.pathsep)


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


class MiniHadoop:
    """Owns the MiniHadoop JVM: start() waits for READY, stop() tears down."""

    def __init__(self, root: Optional[str] = None, secure: bool = False) -> None:
        self.secure = secure
        self.root = root or tempfile.mkdtemp(prefix="ember-hadoop-")
        self.conf_dir = os.path.join(self.root, "conf")
        self.work_dir = os.path.join(self.root, "work")
        self.log_path = os.path.join(self.root, "minihadoop.log")
        self.proc: Optional[subprocess.Popen] = None
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.startup_s = 0.0

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def start(self) -> HadoopCluster:
        classpath = _build()
        os.makedirs(self.work_dir, exist_ok=True)
        cmd = [_java(), "-Xmx1g", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
               "-Djava.net.preferIPv4Stack=true",
               # log4j level of the JVM's log (root/minihadoop.log)
               "-Dember.hadoop.log.level=" + os.environ.get("EMBER_HADOOP_LOG_LEVEL", "WARN"),
               *JAVA17_OPENS,
               "-cp", os.pathsep.join(classpath), "org.ember.hadoop.MiniHadoop",
               "--conf-dir", self.conf_dir, "--work-dir", self.work_dir,
               *(["--secure"] if self.secure else []),
               # Spark executors on YARN fork Python workers and Ember nodes
               # (TensorFlow: GBs of virtual memory) outside the JVM's heap:
               # no vmem/pmem kill switch in a test (as Spark's docs advise
               # for Python-heavy jobs); container sizes still bound the
               # scheduler's placement.
               "-Dyarn.nodemanager.vmem-check-enabled=false",
               "-Dyarn.nodemanager.pmem-check-enabled=false",
               # room for an AM + 2 executors of 2 GiB (bookkeeping only:
               # nothing is reserved or enforced)
               # (MiniYARNCluster sizes its NodeManager from this key, not
               # yarn.nodemanager.resource.memory-mb)
               "-Dyarn.minicluster.yarn.nodemanager.resource.memory-mb=8192"]
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            # cwd: MiniYARNCluster works under ./target; start_new_session: a
            # Ctrl-C in pytest reaches pytest, which then tears us down.
            self.proc = subprocess.Popen(cmd, cwd=self.work_dir, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True,
                                         start_new_session=True)
        threading.Thread(target=self._pump, name="minihadoop-stdout", daemon=True).start()
        deadline = t0 + START_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise RuntimeError(f"the test Hadoop did not print READY within "
                                   f"{START_TIMEOUT_S:.0f}s; log {self.log_path}:\n"
                                   f"{_tail(self.log_path)}")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None or line.startswith("EMBER-HADOOP FAILED"):
                tail = _tail(self.log_path)
                self.stop()
                raise RuntimeError(f"the test Hadoop failed to start: "
                                   f"{line or 'JVM exited'}; log:\n{tail}")
            if line.startswith("EMBER-HADOOP READY "):
                break
        self.startup_s = time.monotonic() - t0
        fields = dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
        common = dict(fs=fields["fs"], webhdfs=fields["webhdfs"], rm=fields["rm"],
                      rm_web=fields["rm_web"], conf_dir=fields["conf"],
                      user=fields["user"], root=self.root, log=self.log_path)
        if not self.secure:
            return HadoopCluster(**common)
        return KerberizedHadoop(
            **common, realm=fields["realm"], krb5_conf=fields["krb5conf"],
            principal=fields["principal"], keytab=fields["keytab"],
            other_principal=fields["other_principal"], other_keytab=fields["other_keytab"],
            token_file=fields["token_file"], expired_token_file=fields["expired_token_file"])

    def stop(self, timeout: float = 60.0) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                assert p.stdin is not None
                p.stdin.close()  # MiniHadoop stops both clusters on EOF
            except OSError:
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def hadoop_cluster() -> Iterator[HadoopCluster]:
    """HDFS + YARN mini clusters on 127.0.0.1, shared by the session."""
    mh = MiniHadoop()
    cluster = mh.start()
    print(f"\n[hadoop_cluster] up in {mh.startup_s:.1f}s: fs={cluster.fs} "
          f"webhdfs={cluster.webhdfs} rm={cluster.rm}")
    try:
        yield cluster
    finally:
        mh.stop()


@pytest.fixture(scope="session")
def kerberized_hadoop() -> Iterator[KerberizedHadoop]:
    """A Kerberized HDFS and YARN with their KDC on localhost, shared by the session."""
    if shutil.which("kinit") is None:
        pytest.fail("MIT Kerberos's kinit is missing (Debian package krb5-user; `make setup` "
                    "installs it)")
    mh = MiniHadoop(secure=True)
    cluster = mh.start()
    assert isinstance(cluster, KerberizedHadoop)
    print(f"\n[kerberized_hadoop] up in {mh.startup_s:.1f}s: fs={cluster.fs} "
          f"webhdfs={cluster.webhdfs} realm={cluster.realm}")
    try:
        yield cluster
    finally:
        mh.stop()


@pytest.fixture(scope="module")
def yarn(hadoop_cluster: HadoopCluster) -> Iterator[HadoopCluster]:
    """The mini cluster, with HADOOP_CONF_DIR set and the AM's classpath for
    ember.yarn.run_on_yarn: a MiniYARNCluster has no HADOOP_HOME, so the AM
    gets the jars the mini cluster itself runs on (build/hadoop/classpath.txt)."""
    with open(os.path.join(BUILD_DIR, "classpath.txt")) as f:
        classpath = f.read().strip()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HADOOP_CONF_DIR", hadoop_cluster.conf_dir)
        mp.setenv("EMBER_YARN_AM_CLASSPATH", classpath)
        yield hadoop_cluster
