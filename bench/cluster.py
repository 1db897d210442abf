"""make bench-cluster: allreduce and the feed over TCP between hosts.

The hosts are simulated on this machine (tests/python/simcluster.py): each is
a network namespace with its own hostname and an ``eth0`` on one bridge, so
every byte between two ranks crosses a real TCP connection between two
network stacks (veth + bridge), as between machines; nothing is shared
between ranks but the CPUs.  Needs root.

Measured in the same run, in interleaved rounds (every side once per round,
the order rotated from round to round), all in GB/s = 1e9 bytes/s:

  stream   one TCP stream between two hosts: build/bench/tcp_stream (C,
           blocking send()/recv(), the kernel's buffer autotuning), the best
           of 32 KiB-1 MiB writes and reads (STREAM_WRITES; 4 MiB buffers,
           which no longer fit the cache, gave 1.9 GB/s where 512 KiB gave
           3.0-3.4): the ceiling for anything that moves bytes from one host
           to another
  streams  a ring of such streams over n hosts: each host's one process
           writes to the next host while it reads from the previous (for 2:
           both ways between h0 and h1) in one non-blocking loop, as a rank of
           a ring allreduce does; the mean per link.  What each link carries
           when all n are busy for seconds here, where the simulated hosts
           share two cores (on real hosts, with CPUs of their own, it is the
           single stream); same buffer sizes.  Not a ceiling for an
           allreduce's bursts of a few MiB: Ember's 2-rank allreduce carries
           more
  ember    Ember's allreduce (ember._ember.Communicator, tcp_only=True, which
           only asserts what the hosts' separate /dev/shm already imply), one
           rank per host, rendezvous on the hosts' addresses
  mpi      Open MPI (Debian's openmpi-bin; bench/mpi_allreduce.c) with
           ``--mca pml ob1 --mca btl tcp,self`` across the hosts (pml ob1, as
           in bench/allreduce.py, so that no UCX pml can bypass the btl
           choice: the simulated hosts share one kernel, where UCX could use
           shared memory or CMA between them): mpirun on the first host,
           its daemons started on the others through ``plm_rsh_agent`` (a
           script that enters the host's namespace, in place of ssh)
  gloo     torch.distributed gloo (the venv's torch, as in bench/allreduce.py),
           GLOO_SOCKET_IFNAME=eth0
  feed     Ember's feed: a FeedServer on one host, a FeedClient on another
           (shared memory off), 4 MiB chunks (one float32 column of 1024 x
           1024), timed on the server from the first batch to the last
  ember_enc, feed_enc
           the same two with encrypt=True (AES-256-GCM records, secure.h),
           in the same rounds as their clear runs; the report gives each
           encrypted median over the clear one (feed_enc_vs_clear, and
           allreduce_enc_vs_clear: the lowest over rank counts and sizes)
           With --link-gbit G (default 10), the encrypted and clear runs
           are also made with every link limited to G Gbit/s (tbf at both
           ends, as a real NIC's rate): feed_enc_vs_clear_<G>g and
           allreduce_enc_vs_clear_<G>g.  Unlimited, the simulated hosts'
           links run at what the shared cores can copy, and the cipher
           competes with those copies; at a NIC's rate it competes only with
           whatever else the cores do.

Each side runs in its best configuration here: Open MPI with ``--bind-to
none`` (each simulated host's daemon would otherwise pin its rank to core 0,
i.e. every rank onto the same physical core: 24 ms per 1 MiB call) and
``--mca mpi_yield_when_idle 1`` (Open MPI's setting for more processes than
cores; its busy polling otherwise starves the other ranks: 4 ranks, 1 MiB,
0.22 s per call instead of 0.03 s), TCP defaults otherwise, which autotune
socket buffers (--mpi-extra adds options, e.g. ``--mca btl_tcp_links 2``);
gloo with one intra-op thread per rank, as in bench/allreduce.py; Ember with
its defaults (a ring, TCP only).  TCP congestion control is the machine's
default in every namespace (bbr here) for all sides.

Allreduce: float32 sum, in place; per size, warm-up calls, a barrier, then
budget / size calls (at most 1000: about a second of calls per size and
side); the slowest rank's mean time per call.  The table names the algorithm
Ember's allreduce took at each size (collective.h).  busbw = bytes *
2(n-1)/n / time (nccl-tests' bus bandwidth: what each rank's link carries).

    make bench-cluster                            # 2 and 4 ranks, 1..256 MiB, 3 rounds
    EMBER_BENCH_QUICK=1 make bench-cluster        # smoke run: 1 MiB, 1 round (< 1 minute)
    python bench/cluster.py --ranks 2 --sizes 1M,64M --rounds 5

The last line is
RESULT bench-cluster vs_best_min=<x> vs_best_min_2r=<x> vs_best_min_4r=<x>
  vs_stream_2r_max=<x> vs_stream_4r_max=<x> vs_streams_2r_max=<x> vs_streams_4r_max=<x>
  stream_gbs=<x> streams_2r_gbs=<x> streams_4r_gbs=<x> feed_tcp_gbs=<x> feed_vs_stream=<x>
  feed_enc_vs_clear=<x> allreduce_enc_vs_clear=<x> feed_enc_gbs=<x>
  feed_enc_vs_clear_<G>g=<x> allreduce_enc_vs_clear_<G>g=<x>
  allreduce_<n>r_<size>_gbs=<x> mpi_<n>r_<size>_gbs=<x> gloo_<n>r_<size>_gbs=<x>
  allreduce_enc_<n>r_<size>_gbs=<x> ...
  [not_measured=mpi,gloo]  (a peer not installed here; its keys are nan)
where vs_best_min_<n>r is the smallest, over sizes, of Ember's median busbw
over the better of Open MPI's and gloo's medians (the like-for-like ratio;
vs_best_min is the smaller over rank counts) and vs_stream_2r_max the
largest of Ember's 2-rank median busbw over the stream's median
(vs_streams_<n>r_max: over the n-host ring of streams' median).  Where
network namespaces cannot be made (not root, no iproute2), it prints why and
ends with RESULT bench-cluster skipped=netns_unavailable (exit status 0).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# bench/ is this script's path: the shared interleaved rounds, and the
# single-host benchmark's size syntax and timed loop
import rounds
from allreduce import cell, human, iters_for, kv, med, parse_size, time_ember, worker_gloo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = b"ember-bench-cluster-secret-0032b"
PREFIX = "embbc"
HOSTS = ["h0", "h1", "h2", "h3"]
EMBER_PORT = 29400
GLOO_PORT = 29500
FEED_PORT = 29600
STREAM_PORT = 29700
STREAM_WRITES = (32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20)  # tried each round
CHUNK = 4 << 20  # feed chunk: one float32 column, 1024 rows of 1024
DEFAULT_SIZES = "1M,4M,16M,64M,256M"
# Calls per size and launch: budget / size, at most this.  About a second of
# each side's calls per size: 100 calls of 1 MiB (0.1 s) left every side's
# rounds spread over 2x here.
CALLS_MOST = 1000
GLOO_PYTHON = sys.executable


# ---------------------------------------------------------------- workers (one per host)

def worker_ember(rank: int, addresses: List[str], plan: List[List[int]],
                 encrypt: bool = False) -> None:
    sys.path.insert(0, os.path.join(REPO, "python"))
    from ember import _ember as E

    host = addresses[rank].rsplit(":", 1)[0]
    comm = E.Communicator(rank, addresses, SECRET, 120.0, bind_host=host, tcp_only=True,
                          encrypt=encrypt)
    time_ember(comm, rank, plan)


def worker_feed_server(host: str, chunks: int, encrypt: bool = False) -> None:
    """Pops `chunks` batches; times the first to the last (bytes of the column)."""
    sys.path.insert(0, os.path.join(REPO, "python"))
    from ember import _ember as E

    srv = E.FeedServer(SECRET, host=host, port=FEED_PORT, shm=False, encrypt=encrypt)
    print("ready", flush=True)
    got, nbytes, t0 = 0, 0, 0.0
    while got < chunks:
        item = srv.next(120.0)
        if item is None:
            raise RuntimeError("feed stalled after %d of %d chunks" % (got, chunks))
        if item.kind != "batch":
            continue
        if got == 0:
            t0 = time.perf_counter()
        else:  # the first batch only starts the clock
            nbytes += CHUNK
        got += 1
        item.release()
    dt = time.perf_counter() - t0
    print(json.dumps({"bytes": nbytes, "sec": dt}), flush=True)
    time.sleep(0.5)  # let the client's end_partition be acknowledged
    srv.close()


def worker_feed_client(host: str, chunks: int, encrypt: bool = False) -> None:
    sys.path.insert(0, os.path.join(REPO, "python"))
    import numpy as np
    from ember import _ember as E

    x = np.ones((1024, 1024), dtype=np.float32)
    assert x.nbytes == CHUNK
    with E.FeedClient(host, FEED_PORT, SECRET, 0, timeout_s=60.0, shm=False,
                      encrypt=encrypt) as c:
        for _ in range(chunks):
            c.send([("x", E.DT_F32, 1024, x, None)], 1024, 60.0)
        c.end_partition(60.0)


# ---------------------------------------------------------------- sides

class Bench:
    def __init__(self, sim, args) -> None:
        self.sim = sim
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="ember-bench-cluster-")
        self.ember_algorithm: Dict[Tuple[int, int], str] = {}  # (ranks, size) -> name
        self.agent = os.path.join(self.tmp, "netns-rsh")
        # ssh's contract for Open MPI: "agent HOST CMD..." runs CMD (a shell
        # command line) on HOST.  Here HOST is entered exactly as
        # SimCluster.command enters it (namespaces, hostname, /dev/shm), from
        # this process's mount namespace: the agent itself runs on a simulated
        # host, whose /dev/shm hides the other hosts' directories.
        with open(self.agent, "w") as f:
            f.write("#!%s\nimport os, sys\nsys.path.insert(0, %r)\nimport simcluster\n"
                    "sim = simcluster.SimCluster(%r, prefix=%r)\n"
                    "argv = ['nsenter', '--mount=/proc/%d/ns/mnt', '--'] + sim.command(\n"
                    "    sys.argv[1], ['sh', '-c', ' '.join(sys.argv[2:])])\n"
                    "os.execvp(argv[0], argv)\n"
                    % (GLOO_PYTHON, os.path.join(REPO, "tests", "python"), sim.hosts, PREFIX,
                       os.getpid()))
        os.chmod(self.agent, 0o755)

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _collect(self, procs: List[subprocess.Popen], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        try:
            out, err = procs[0].communicate(timeout=timeout)
            for p in procs[1:]:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError("exit codes %s; rank 0 stderr: %s" % (codes, (err or "")[-1500:]))
        return out

    @staticmethod
    def _by_size(out: str) -> Dict[int, float]:
        res = {}
        for line in out.splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                res[d["size"]] = d["sec"]
        return res

    def _plan(self, sizes: Sequence[int]) -> str:
        return json.dumps([[s, iters_for(s, self.args.budget, CALLS_MOST)] for s in sizes])

    def _stream(self, write: int) -> float:
        """One TCP stream h0 -> h1 of write-byte writes and reads; GB/s."""
        exe = os.path.join(REPO, "build", "bench", "tcp_stream")
        rx = self.sim.popen("h1", [exe, "recv", str(STREAM_PORT), "0", str(write)],
                            stdout=subprocess.PIPE, text=True)
        assert rx.stdout is not None
        if rx.stdout.readline().strip() != "ready":
            rx.kill()
            rx.wait()
            raise RuntimeError("tcp_stream receiver did not start")
        self.sim.run("h0", [exe, "send", self.sim.addr("h1"), str(STREAM_PORT),
                            str(self.args.stream_seconds), str(write)], check=True, timeout=120)
        out = self._collect([rx], 60)
        _, nbytes, sec = out.split()[-3:]
        return int(nbytes) / float(sec) / 1e9

    def _ring(self, n: int, write: int) -> List[float]:
        """One tcp_stream ring process per host h0..h(n-1), each writing to
        the next host while it reads from the previous one in one
        non-blocking loop; each host's received GB/s."""
        exe = os.path.join(REPO, "build", "bench", "tcp_stream")
        procs = []
        try:
            for i in range(n):
                nxt = HOSTS[(i + 1) % n]
                p = self.sim.popen(HOSTS[i], [exe, "ring", str(STREAM_PORT), self.sim.addr(nxt),
                                              str(STREAM_PORT), str(self.args.stream_seconds),
                                              str(write)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                procs.append(p)
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError("tcp_stream ring did not start on %s" % HOSTS[i])
            for p in procs:  # every host listens: connect
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            got = []
            for p in procs:
                out, _ = p.communicate(timeout=120)
                if p.returncode != 0:
                    raise RuntimeError("tcp_stream ring failed")
                _, nbytes, sec = out.split()[-3:]
                got.append(int(nbytes) / float(sec) / 1e9)
            return got
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def stream(self, n: int = 1) -> float:
        """n = 1: one stream h0 -> h1.  n >= 2: a ring of streams, each host
        writing to the next while it reads from the previous (for 2: both
        ways between h0 and h1) in one process, as a rank of a ring allreduce
        does: the mean per link, what each link carries when all n are busy
        here, where the simulated hosts share two cores (on real hosts, with
        CPUs of their own, it is the single stream).  The best over
        STREAM_WRITES (reads of the same size): a stream's buffer size is the
        setting that matters here, 4 MiB buffers no longer fit the cache."""
        if n == 1:
            return max(self._stream(w) for w in STREAM_WRITES)
        return max(sum(got) / len(got) for got in (self._ring(n, w) for w in STREAM_WRITES))

    def ember(self, n: int, sizes: Sequence[int], encrypt: bool = False) -> Dict[int, float]:
        addrs = ",".join("%s:%d" % (self.sim.addr(h), EMBER_PORT) for h in HOSTS[:n])
        procs = [self.sim.popen(HOSTS[r], [sys.executable, os.path.abspath(__file__),
                                           "--worker", "ember", "--rank", str(r),
                                           "--addresses", addrs, "--plan", self._plan(sizes)]
                                + (["--encrypt"] if encrypt else []),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(n)]
        out = self._collect(procs, self.args.timeout)
        for line in out.splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                self.ember_algorithm[(n, d["size"])] = d["algorithm"]
        return self._by_size(out)

    def ember_enc(self, n: int, sizes: Sequence[int]) -> Dict[int, float]:
        return self.ember(n, sizes, encrypt=True)

    def gloo(self, n: int, sizes: Sequence[int]) -> Dict[int, float]:
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
        env.pop("PYTHONPATH", None)
        procs = [self.sim.popen(HOSTS[r], [GLOO_PYTHON, os.path.abspath(__file__),
                                           "--worker", "gloo", "--rank", str(r), "--world",
                                           str(n), "--master", self.sim.addr("h0"),
                                           "--plan", self._plan(sizes)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
                 for r in range(n)]
        return self._by_size(self._collect(procs, self.args.timeout))

    def mpi(self, n: int, sizes: Sequence[int]) -> Dict[int, float]:
        exe = os.path.join(REPO, "build", "bench", "mpi_allreduce")
        cmd = ["mpirun", "-np", str(n), "--host", ",".join(HOSTS[:n]), "--oversubscribe",
               "--bind-to", "none", "--mca", "plm_rsh_agent", self.agent,
               "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
               "--mca", "btl_tcp_if_include", "eth0",
               "--mca", "oob_tcp_if_include", "eth0", "--mca", "mpi_yield_when_idle", "1"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd += self.args.mpi_extra.split()
        cmd += [exe] + ["%d:%d" % (s, i) for s, i in json.loads(self._plan(sizes))]
        p = self.sim.popen("h0", cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = self._collect([p], self.args.timeout)
        res = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "mpi":
                res[int(parts[1])] = float(parts[2])
        return res

    def feed(self, encrypt: bool = False) -> float:
        chunks = self.args.feed_chunks
        enc = ["--encrypt"] if encrypt else []
        srv = self.sim.popen("h1", [sys.executable, os.path.abspath(__file__), "--worker",
                                    "feed_server", "--host", self.sim.addr("h1"),
                                    "--chunks", str(chunks)] + enc,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert srv.stdout is not None
        if srv.stdout.readline().strip() != "ready":
            raise RuntimeError("feed server did not start: %s" % srv.stderr.read()[-1500:])
        cli = self.sim.popen("h0", [sys.executable, os.path.abspath(__file__), "--worker",
                                    "feed_client", "--host", self.sim.addr("h1"),
                                    "--chunks", str(chunks)] + enc,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = self._collect([srv, cli], self.args.timeout)
        d = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
        return d["bytes"] / d["sec"] / 1e9


# ---------------------------------------------------------------- report

def main() -> int:
    quick = os.environ.get("EMBER_BENCH_QUICK", "") not in ("", "0")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sizes", default="1M" if quick else DEFAULT_SIZES)
    ap.add_argument("--rounds", type=int, default=1 if quick else 3)
    ap.add_argument("--budget", type=parse_size, default=parse_size("16M" if quick else "1G"),
                    help="bytes of buffer per size and launch (calls = budget / size, "
                         "3..%d)" % CALLS_MOST)
    ap.add_argument("--stream-seconds", type=float, default=0.5 if quick else 2.0)
    ap.add_argument("--feed-chunks", type=int, default=64 if quick else 512)
    ap.add_argument("--mpi-extra", default="", help="more mpirun options, e.g. '--mca btl_tcp_links 2'")
    ap.add_argument("--sides", default="stream,ember,ember_enc,mpi,gloo,feed,feed_enc")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--link-gbit", dest="link_gbit", type=float, default=10.0,
                    help="also measure the encrypted sides against clear with every link "
                         "limited to this many Gbit/s (a real NIC's rate; 0: not)")
    # worker modes (internal)
    ap.add_argument("--worker", choices=["ember", "gloo", "feed_server", "feed_client"])
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--addresses")
    ap.add_argument("--master")
    ap.add_argument("--plan")
    ap.add_argument("--host")
    ap.add_argument("--chunks", type=int)
    ap.add_argument("--encrypt", action="store_true")
    args = ap.parse_args()

    if args.worker == "ember":
        worker_ember(args.rank, args.addresses.split(","), json.loads(args.plan), args.encrypt)
        return 0
    if args.worker == "gloo":
        worker_gloo(args.rank, args.world, "tcp://%s:%d" % (args.master, GLOO_PORT),
                    json.loads(args.plan))
        return 0
    if args.worker == "feed_server":
        worker_feed_server(args.host, args.chunks, args.encrypt)
        return 0
    if args.worker == "feed_client":
        worker_feed_client(args.host, args.chunks, args.encrypt)
        return 0

    sys.path.insert(0, os.path.join(REPO, "tests", "python"))
    import simcluster

    why = simcluster.available()
    if why is not None:  # not a failure: this machine cannot simulate hosts
        print("bench-cluster skipped: it needs network namespaces: %s" % why)
        print("RESULT bench-cluster skipped=netns_unavailable")
        return 0
    ranks = [int(r) for r in args.ranks.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    sides = args.sides.split(",")
    not_measured: List[str] = []  # peers that cannot run here (not installed)
    if any(s % 4 for s in sizes):
        ap.error("sizes must be multiples of 4 bytes (float32)")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if "mpi" in sides and not (shutil.which("mpirun") and
                               os.path.exists(os.path.join(REPO, "build/bench/mpi_allreduce"))):
        print("note: mpirun or build/bench/mpi_allreduce missing: mpi is n/a")
        sides.remove("mpi")
        not_measured.append("mpi")
    if "gloo" in sides and subprocess.run(
            [GLOO_PYTHON, "-c", "import torch.distributed as d; assert d.is_gloo_available()"],
            capture_output=True).returncode != 0:
        print("note: %s cannot import torch with gloo: "
              "gloo is n/a" % GLOO_PYTHON)
        sides.remove("gloo")
        not_measured.append("gloo")

    # results[side][n][size] -> list over rounds; stream and feed: list over rounds
    coll = {s: {n: {z: [] for z in sizes} for n in ranks}
            for s in ("ember", "ember_enc", "mpi", "gloo", "ember_link", "ember_enc_link")}
    stream: List[float] = []
    ring_streams: Dict[int, List[float]] = {n: [] for n in ranks}
    feed: List[float] = []
    feed_enc: List[float] = []
    feed_link: List[float] = []
    feed_enc_link: List[float] = []
    link_bits = int(args.link_gbit * 1e9)
    t_start = time.monotonic()
    with simcluster.SimCluster(HOSTS[:max(max(ranks), 2)], prefix=PREFIX) as sim:
        bench = Bench(sim, args)
        try:
            # name -> one launch; rotated each round so no side always goes first
            jobs: Dict[str, Callable[[], None]] = {}
            if "stream" in sides:
                jobs["stream"] = lambda: stream.append(bench.stream())
                for n in ranks:
                    jobs["%d streams" % n] = lambda n=n: ring_streams[n].append(bench.stream(n))
            if "feed" in sides:
                jobs["feed"] = lambda: feed.append(bench.feed())
            if "feed_enc" in sides:
                jobs["feed_enc"] = lambda: feed_enc.append(bench.feed(encrypt=True))
            if "feed_enc" in sides and link_bits > 0:
                # a NIC's rate: the regime where the cipher has cores to spare
                def limited_feed(out: List[float], encrypt: bool) -> None:
                    with sim.rate_limited(link_bits):
                        out.append(bench.feed(encrypt=encrypt))
                jobs["feed @link"] = lambda: limited_feed(feed_link, False)
                jobs["feed_enc @link"] = lambda: limited_feed(feed_enc_link, True)
            for n in ranks:
                for side in ("ember", "ember_enc", "mpi", "gloo"):
                    if side in sides:
                        def run(side=side, n=n) -> None:
                            got = getattr(bench, side)(n, sizes)
                            for z in sizes:
                                sec = got.get(z)
                                coll[side][n][z].append(z * 2.0 * (n - 1) / n / sec / 1e9
                                                        if sec else float("nan"))
                        jobs["%s %d ranks" % (side, n)] = run
                if "ember_enc" in sides and link_bits > 0:
                    for side, enc in (("ember_link", False), ("ember_enc_link", True)):
                        def run_link(side=side, n=n, enc=enc) -> None:
                            with sim.rate_limited(link_bits):
                                got = bench.ember(n, sizes, encrypt=enc)
                            for z in sizes:
                                sec = got.get(z)
                                coll[side][n][z].append(z * 2.0 * (n - 1) / n / sec / 1e9
                                                        if sec else float("nan"))
                        jobs["%s %d ranks" % (side, n)] = run_link

            def report(r: int, name: str, _: None, secs: float) -> None:
                print("round %d: %-14s %5.1f s" % (r + 1, name, secs), flush=True)

            def failed(r: int, name: str, e: Exception, secs: float) -> None:
                # one failed launch is a gap, not the end
                print("round %d: %s failed: %s" % (r + 1, name, e))
                report(r, name, None, secs)

            rounds.interleaved(args.rounds, jobs, report=report, failed=failed)
        finally:
            bench.close()

    print("\n%d rounds, %.0f s; GB/s = 1e9 bytes/s, median [min-max] over rounds; "
          "busbw = bytes * 2(n-1)/n / time" % (args.rounds, time.monotonic() - t_start))
    s_med = med(stream)
    print("one TCP stream h0 -> h1: %s" % cell(stream, 20))
    for n in ranks:
        print("a ring of TCP streams over %d hosts, per link: %s" % (n, cell(ring_streams[n], 20)))
    if feed:
        print("Ember feed h0 -> h1 (TCP, 4 MiB chunks): %s" % cell(feed, 20))
    if feed_enc:
        print("Ember feed h0 -> h1 encrypted (AES-256-GCM): %s" % cell(feed_enc, 20))
    if feed_enc_link:
        print("links at %g Gbit/s: Ember feed h0 -> h1 clear %s, encrypted %s"
              % (args.link_gbit, cell(feed_link, 20), cell(feed_enc_link, 20)))
    result = {}
    best_min: Dict[int, Optional[float]] = {}
    stream_max: Dict[int, Optional[float]] = {}
    ring_max: Dict[int, Optional[float]] = {}
    ring_gbs: Dict[int, Optional[float]] = {}
    enc_ratios: List[float] = []  # encrypted over clear allreduce, every (n, size)
    enc_link_ratios: List[float] = []  # the same with the links rate-limited
    for n in ranks:
        print("\n== allreduce, %d ranks on %d hosts: busbw GB/s" % (n, n))
        print("%8s  %-20s %-20s %-20s %9s %9s %10s %10s  %s" % (
            "size", "ember", "mpi (tcp)", "gloo", "e/mpi", "e/gloo", "e/stream", "e/streams",
            "ember's algorithm"))
        ratios, vs_stream, vs_ring = [], [], []
        r_med = med(ring_streams[n])
        for z in sizes:
            e, m, g = (med(coll[s][n][z]) for s in ("ember", "mpi", "gloo"))

            def rt(a: Optional[float], b: Optional[float]) -> str:
                return "%8.2fx" % (a / b) if a is not None and b else "      n/a"
            print("%8s  %s %s %s %s %s %s %s  %s" % (human(z), cell(coll["ember"][n][z], 20),
                                                    cell(coll["mpi"][n][z], 20),
                                                    cell(coll["gloo"][n][z], 20),
                                                    rt(e, m), rt(e, g), " " + rt(e, s_med),
                                                    " " + rt(e, r_med),
                                                    bench.ember_algorithm.get((n, z), "")))
            tag = "%dr_%s" % (n, human(z))
            result["allreduce_%s_gbs" % tag] = e
            result["mpi_%s_gbs" % tag] = m
            result["gloo_%s_gbs" % tag] = g
            peers = [x for x in (m, g) if x is not None]
            if e is not None and peers:
                ratios.append(e / max(peers))
            if e is not None and s_med:
                vs_stream.append(e / s_med)
            if e is not None and r_med:
                vs_ring.append(e / r_med)
        best_min[n] = min(ratios) if ratios else None
        if "ember_enc" in sides:
            print("   encrypted (encrypt=True) vs clear, the same rounds:")
            for z in sizes:
                e, x = med(coll["ember"][n][z]), med(coll["ember_enc"][n][z])
                print("%8s  %s %s" % (human(z), cell(coll["ember_enc"][n][z], 20),
                                      rt(x, e)))
                result["allreduce_enc_%dr_%s_gbs" % (n, human(z))] = x
                if e and x is not None:
                    enc_ratios.append(x / e)
            if link_bits > 0:
                print("   at %g Gbit/s links: clear, encrypted, encrypted/clear:" % args.link_gbit)
                for z in sizes:
                    e = med(coll["ember_link"][n][z])
                    x = med(coll["ember_enc_link"][n][z])
                    print("%8s  %s %s %s" % (human(z), cell(coll["ember_link"][n][z], 20),
                                             cell(coll["ember_enc_link"][n][z], 20), rt(x, e)))
                    if e and x is not None:
                        enc_link_ratios.append(x / e)
        stream_max[n] = max(vs_stream) if vs_stream else None
        ring_max[n] = max(vs_ring) if vs_ring else None
        ring_gbs[n] = r_med
    print()
    mins = [x for x in best_min.values() if x is not None]
    head = ["vs_best_min=%s" % kv(min(mins) if mins else None)]
    head += ["vs_best_min_%dr=%s" % (n, kv(best_min[n])) for n in ranks]
    head += ["vs_stream_%dr_max=%s" % (n, kv(stream_max[n])) for n in ranks]
    head += ["vs_streams_%dr_max=%s" % (n, kv(ring_max[n])) for n in ranks]
    f_med = med(feed)
    head += ["stream_gbs=%s" % kv(s_med)]
    head += ["streams_%dr_gbs=%s" % (n, kv(ring_gbs[n])) for n in ranks]
    head += ["feed_tcp_gbs=%s" % kv(f_med),
             "feed_vs_stream=%s" % kv(f_med / s_med if f_med is not None and s_med else None)]
    fe_med = med(feed_enc)
    head += ["feed_enc_vs_clear=%s" % kv(fe_med / f_med if fe_med is not None and f_med
                                          else None),
             "allreduce_enc_vs_clear=%s" % kv(min(enc_ratios) if enc_ratios else None),
             "feed_enc_gbs=%s" % kv(fe_med)]
    if link_bits > 0:
        fl, fel = med(feed_link), med(feed_enc_link)
        tag = "%gg" % args.link_gbit
        head += ["feed_enc_vs_clear_%s=%s" % (tag, kv(fel / fl if fel is not None and fl
                                                      else None)),
                 "allreduce_enc_vs_clear_%s=%s" % (tag, kv(min(enc_link_ratios)
                                                           if enc_link_ratios else None))]
    tail = ["%s=%s" % (k, kv(v)) for k, v in result.items()]
    if not_measured:
        tail.append("not_measured=" + ",".join(not_measured))
    print("RESULT bench-cluster " + " ".join(head + tail))
    # A side that failed is a gap in the table; Ember failing is a failed run.
    missing = "ember" in sides and any(result["allreduce_%dr_%s_gbs" % (n, human(z))] is None
                                       for n in ranks for z in sizes)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
