"""A simulated cluster of hosts on this machine, for tests and benchmarks.

Each host is a Linux network namespace with a UTS namespace of its own (so
``hostname`` differs) and a /dev/shm of its own, one interface ``eth0`` with an address in the
benchmarking range 198.18.0.0/15, and the other hosts' names in its
``/etc/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts``).
The hosts' interfaces meet on a bridge inside a namespace of its own (the
switch), so nothing is added to the machine's own network namespace and no
traffic leaves the namespaces.  Needs root (CI runs as root).

Everything is torn down by :meth:`SimCluster.close`: every process started in
a host namespace is killed, the namespaces, links and ``/etc/netns`` entries
are removed.  A cluster left behind by a killed run (same prefix) is removed
before a new one is made.

    with SimCluster(["master", "w1", "w2"], prefix="embt") as sim:
        sim.run("w1", ["ping", "-c1", "master"])
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

SUBNET = "198.18.0"  #: hosts get .1, .2, ... of 198.18.0.0/24 (RFC 2544's range)
NETNS_ETC = "/etc/netns"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@functools.lru_cache(maxsize=None)
def available() -> Optional[str]:
    """None when namespaces can be made here, else why not (for a skip reason).
    Probed once per process: several test modules ask at collection."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2's ip and util-linux's unshare are needed"
    probe = f"embprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class SimCluster:
    """Hosts ``hosts`` (names) as network + UTS namespaces on one bridge."""

    def __init__(self, hosts: Sequence[str], prefix: str = "emb", mtu: int = 1500) -> None:
        if len(hosts) > 250:
            raise ValueError("at most 250 hosts")
        self.hosts = list(hosts)
        self.prefix = prefix
        self.mtu = mtu
        self._addr = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(self.hosts)}
        self._procs: List[subprocess.Popen] = []
        self._up = False
        # the switch's drop rules in force (_apply_drops)
        self._partitions: List[Tuple[str, str]] = []
        self._loss: Dict[str, float] = {}

    # -- names -------------------------------------------------------------
    def ns(self, host: str) -> str:
        """The network namespace of ``host``."""
        return f"{self.prefix}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-switch"

    def addr(self, host: str) -> str:
        return self._addr[host]

    def _namespaces(self) -> List[str]:
        return [self.switch] + [self.ns(h) for h in self.hosts]

    # -- lifecycle ---------------------------------------------------------
    def __enter__(self) -> "SimCluster":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        self._remove_leftovers()
        self._up = True
        try:
            _ip("netns", "add", self.switch)
            sw = ["-n", self.switch]
            _ip(*sw, "link", "add", "br0", "type", "bridge")
            _ip(*sw, "link", "set", "br0", "up")
            _ip(*sw, "link", "set", "lo", "up")
            hosts_file = "127.0.0.1 localhost\n" + "".join(
                f"{a} {h}\n" for h, a in self._addr.items())
            for i, h in enumerate(self.hosts):
                ns = self.ns(h)
                _ip("netns", "add", ns)
                # veth pair made inside the switch namespace, one end moved to the host
                port = f"p{i}"
                _ip(*sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                    "peer", "name", "eth0", "mtu", str(self.mtu), "netns", ns)
                _ip(*sw, "link", "set", port, "master", "br0")
                _ip(*sw, "link", "set", port, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self._addr[h]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
                with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                    f.write(hosts_file)
                with open(os.path.join(NETNS_ETC, ns, "hostname"), "w") as f:
                    f.write(h + "\n")
                os.makedirs(self.shm_dir(h), mode=0o1777, exist_ok=True)
            self._wait_links()
        except BaseException:
            self.close()
            raise

    def _wait_links(self) -> None:
        """Waits until every bridge port forwards (a fresh port may pass through
        the bridge's listening/learning states first)."""
        deadline = time.monotonic() + 30
        while True:
            states = _ip("-n", self.switch, "-d", "link", "show", "master", "br0").stdout
            ports = re.findall(r"bridge_slave state (\w+)", states)
            if len(ports) == len(self.hosts) and all(p == "forwarding" for p in ports):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"bridge ports of {self.switch} not forwarding: {ports}")
            time.sleep(0.1)

    def close(self) -> None:
        for p in self._procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for ns in self._namespaces():
            self._kill_namespace(ns)
        for p in self._procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []
        # the faults go with the switch's and the hosts' namespaces
        self._partitions.clear()
        self._loss.clear()
        for ns in self._namespaces():
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
            shutil.rmtree(os.path.join("/dev/shm", ns), ignore_errors=True)
        try:
            os.rmdir(NETNS_ETC)  # only when empty: other tools may keep entries there
        except OSError:
            pass
        self._up = False

    def _remove_leftovers(self) -> None:
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        for line in listed:
            name = line.split(" ")[0]
            if name.startswith(self.prefix + "-"):
                self._kill_namespace(name)
                _ip("netns", "del", name, check=False)
                shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
                shutil.rmtree(os.path.join("/dev/shm", name), ignore_errors=True)

    @staticmethod
    def _kill_namespace(ns: str) -> None:
        """SIGKILLs every process in ``ns`` until none is left (children included)."""
        for _ in range(50):
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            time.sleep(0.1)

    # -- running things on a host -------------------------------------------
    def command(self, host: str, argv: Sequence[str]) -> List[str]:
        """``argv`` as run on ``host``: in its network namespace (and its
        /etc/hosts) and a new UTS namespace whose hostname is ``host``."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "--mount", "sh", "-c",
                'hostname "$0" && mount --bind "$1" /dev/shm && shift && exec "$@"', host,
                self.shm_dir(host), *argv]

    def shm_dir(self, host: str) -> str:
        """The host's own /dev/shm (a directory of the machine's, bind-mounted
        over /dev/shm for everything run on the host): shared memory is
        per host, as on real machines."""
        return os.path.join("/dev/shm", self.ns(host))

    def popen(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Starts ``argv`` on ``host`` (its own process group; killed by close())."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.command(host, argv), **kw)
        self._procs.append(p)
        return p

    def run(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), **kw)

    def kill_host(self, host: str) -> None:
        """The host dies: every process in its namespace is SIGKILLed."""
        self._kill_namespace(self.ns(host))

    # -- network faults ------------------------------------------------------
    # Each fault is a context manager that undoes it on exit (close() takes
    # whatever is left with the namespaces).  Drops happen in the switch (a bridge-family nftables
    # table), so they are silent as a real network's are: no host sees an
    # error for a frame lost on the wire.  This kernel has no netem qdisc, so
    # loss is nftables' ``numgen random`` and a rate is a tbf qdisc.

    def link_down(self, host: str) -> None:
        """The host's cable is pulled: its interface goes down (processes live on)."""
        _ip("-n", self.ns(host), "link", "set", "eth0", "down")

    def link_up(self, host: str) -> None:
        """The cable is back: the interface is up again (connections that did
        not time out meanwhile carry on)."""
        _ip("-n", self.ns(host), "link", "set", "eth0", "up")

    @contextlib.contextmanager
    def cut(self, host: str) -> Iterator[None]:
        """``host``'s link is down inside the block."""
        self.link_down(host)
        try:
            yield
        finally:
            self.link_up(host)

    @contextlib.contextmanager
    def partitioned(self, a: str, b: str) -> Iterator[None]:
        """``a`` and ``b`` cannot reach each other inside the block; every
        other host still reaches both."""
        pair = (a, b)
        self._partitions.append(pair)
        self._apply_drops()
        try:
            yield
        finally:
            self._partitions.remove(pair)
            self._apply_drops()

    @contextlib.contextmanager
    def lossy(self, percent: float, hosts: Optional[Sequence[str]] = None) -> Iterator[None]:
        """Each link of ``hosts`` (all by default) loses ``percent`` % of the
        frames it carries, in each direction, at random."""
        if not 0 < percent < 100:
            raise ValueError(f"loss percent {percent} not in (0, 100)")
        chosen = list(self.hosts if hosts is None else hosts)
        for h in chosen:
            self._loss[h] = percent
        self._apply_drops()
        try:
            yield
        finally:
            for h in chosen:
                self._loss.pop(h, None)
            self._apply_drops()

    @contextlib.contextmanager
    def rate_limited(self, bits_per_s: int, hosts: Optional[Sequence[str]] = None
                     ) -> Iterator[None]:
        """Each link of ``hosts`` (all by default) carries at most
        ``bits_per_s`` in each direction: a token bucket on both of its ends."""
        chosen = list(self.hosts if hosts is None else hosts)
        # a bucket of 10 ms of traffic, and at least one 64 KiB GSO frame
        burst = max(bits_per_s // 8 // 100, 65536)
        tbf = ["tbf", "rate", f"{bits_per_s}bit", "burst", str(burst), "latency", "50ms"]
        for h in chosen:
            self._tc(self.ns(h), "qdisc", "replace", "dev", "eth0", "root", *tbf)
            self._tc(self.switch, "qdisc", "replace", "dev", self._port(h), "root", *tbf)
        try:
            yield
        finally:
            for h in chosen:
                self._unlimit(h)

    def _port(self, host: str) -> str:
        return f"p{self.hosts.index(host)}"

    @staticmethod
    def _tc(ns: str, *args: str, check: bool = True) -> None:
        subprocess.run(["ip", "netns", "exec", ns, "tc", *args], check=check,
                       capture_output=True, text=True)

    def _unlimit(self, host: str) -> None:
        self._tc(self.ns(host), "qdisc", "del", "dev", "eth0", "root", check=False)
        self._tc(self.switch, "qdisc", "del", "dev", self._port(host), "root", check=False)

    def _apply_drops(self) -> None:
        """Replaces the switch's drop rules with those of the faults in force,
        in one nftables transaction."""
        rules = []
        for a, b in self._partitions:
            pa, pb = self._port(a), self._port(b)
            rules += [f'iifname "{pa}" oifname "{pb}" drop', f'iifname "{pb}" oifname "{pa}" drop']
        for h, percent in self._loss.items():
            # per mille, so 0.1 % steps; one rule per direction of the link
            n = max(1, round(percent * 10))
            rules += [f'iifname "{self._port(h)}" numgen random mod 1000 < {n} drop',
                      f'oifname "{self._port(h)}" numgen random mod 1000 < {n} drop']
        script = "add table bridge embfault\ndelete table bridge embfault\n"
        if rules:
            script += ("table bridge embfault {\n chain forward {\n"
                       "  type filter hook forward priority 0; policy accept;\n"
                       + "".join(f"  {r}\n" for r in rules) + " }\n}\n")
        r = subprocess.run(["ip", "netns", "exec", self.switch, "nft", "-f", "-"], input=script,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nft in {self.switch} failed: {r.stderr.strip()}\n{script}")

    def env_for(self, host: str, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """An environment for programs on ``host``: Spark binds and advertises the
        host's own address (SPARK_LOCAL_IP / SPARK_LOCAL_HOSTNAME)."""
        env = dict(os.environ if base is None else base)
        env.update(SPARK_LOCAL_IP=self.addr(host), SPARK_LOCAL_HOSTNAME=host)
        return env
