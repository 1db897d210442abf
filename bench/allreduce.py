"""Allreduce on one host, like for like: Ember vs Open MPI over shared memory,
and Ember vs Open MPI vs torch.distributed gloo over TCP loopback, with one
TCP stream over loopback as the TCP ceiling; all measured in the same run.

    make bench-allreduce                      # 2 and 4 ranks, 4 KiB .. 256 MiB, 3 rounds
    EMBER_BENCH_QUICK=1 make bench-allreduce  # tiny sizes, one round (a smoke run)
    python bench/allreduce.py --ranks 2 --sizes 1M,64M --rounds 5

Sides, each in its own documented best configuration:

  ember_shm  Ember's defaults: ranks on one host move data through shared
             memory (checked: every peer's transport() is "shm")
  mpi_shm    Open MPI's defaults (Debian's openmpi-bin 4.1, pml ob1): ranks on
             one host use its shared-memory btl (vader; "sm" in Open MPI 5)
  ember_tcp  Ember with tcp_only=True (the Communicator flag that turns its
             shared memory off; there is no environment variable for it),
             checked: every peer's transport() is "tcp"
  mpi_tcp    Open MPI with ``--mca pml ob1 --mca btl tcp,self`` (TCP only;
             pml ob1 so that no UCX pml can bypass the btl choice)
  gloo       torch.distributed gloo (TCP; the venv's torch, requirements.txt;
             --gloo-python names another interpreter), one intra-op thread
             per rank
  loopback   one TCP stream over loopback (4 MiB sendall()s for a fixed time):
             the ceiling for the TCP sides

Open MPI runs with mpirun's default process binding and --oversubscribe (4
ranks on 2 cores is oversubscribed: Open MPI then yields when idle by itself).
Ember's ranks are bound alike (pin_like_mpirun): rank r to core r when every
rank has a core, unbound otherwise; gloo's likewise.

Every allreduce side runs the same loop (allreduce.seconds_per_call, also used
by bench/cluster.py; Open MPI's in bench/mpi_allreduce.c is its C twin):
float32 sum, in place; per size warm-up calls, a barrier, `iters` calls
(about --budget bytes of buffer, 3..200; for sizes up to 4 MiB, after a
warm-up of at least 20 ms, raised to fill --target-seconds, 50 ms, the ranks
agreeing on the count through the side's own allreduce), and the slowest
rank's mean time per call.  busbw = bytes * 2(n-1)/n / time (nccl-tests' bus bandwidth: what each
rank's link carries in a ring allreduce).  Rounds are interleaved: round r
launches every side once (all sizes, both rank counts; the order rotated from
round to round) before round r+1.  Every figure is the median [min-max] over
the rounds, in GB/s = 1e9 bytes/s.

The headline ratios compare matching transports only: Ember shm / Open MPI
shm, Ember TCP / Open MPI TCP, Ember TCP / gloo.  The last line is

RESULT allreduce shm_vs_ompi_min=<x> tcp_vs_ompi_tcp_min=<x> tcp_vs_gloo_min=<x>
  shm_vs_ompi_max=<x> tcp_vs_ompi_tcp_max=<x> tcp_vs_gloo_max=<x>
  shm_vs_ompi_min_<n>r=<x> tcp_vs_ompi_tcp_min_<n>r=<x> tcp_vs_gloo_min_<n>r=<x> ...
  loopback_gbs=<x> rounds=<r>
  ember_shm_<n>r_<size>_gbs=<x> mpi_shm_... ember_tcp_... mpi_tcp_... gloo_... (every n, size)
  [not_measured=mpi,gloo]

where <a>_vs_<b>_min (_max) is the smallest (largest), over sizes and rank
counts, of Ember's median busbw over the peer's median busbw (the per-rank-count
minimum is _min_<n>r); a peer that is not installed is listed in not_measured
and its keys are nan.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import rounds  # bench/rounds.py (bench/ is this script's path)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = b"ember-bench-allreduce-secret-32b"
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
QUICK_SIZES = "64K,1M"
SIDES = ("ember_shm", "mpi_shm", "ember_tcp", "mpi_tcp", "gloo")
# (Ember side, peer side, RESULT prefix): the like-for-like pairs
PAIRS = (("ember_shm", "mpi_shm", "shm_vs_ompi"),
         ("ember_tcp", "mpi_tcp", "tcp_vs_ompi_tcp"),
         ("ember_tcp", "gloo", "tcp_vs_gloo"))
LABEL = {"ember_shm": "ember shm", "mpi_shm": "ompi shm", "ember_tcp": "ember tcp",
         "mpi_tcp": "ompi tcp", "gloo": "gloo (tcp)"}


def quick_mode() -> bool:
    """EMBER_BENCH_QUICK=1: tiny sizes for a smoke run (make bench-smoke)."""
    return os.environ.get("EMBER_BENCH_QUICK", "") not in ("", "0")


def parse_size(s: str) -> int:
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def human(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return "%d%s" % (n // k, unit)
    return "%dB" % n


MAX_CALLS = 100_000
PROBE_CALLS = 8
WARM_SECONDS = 0.02
CALIBRATED_MAX = 4 << 20  # larger sizes take long enough per call: no probe


def iters_for(size: int, budget: int, most: int = 200) -> int:
    """Calls per size: about `budget` bytes of buffer, 3..most."""
    return max(3, min(most, budget // size))


def warmups_for(size: int) -> int:
    return 1 if size >= (64 << 20) else 2


def calls_for(per_call: float, iters: int, target: float) -> int:
    """At least `iters` calls, as many as fill `target` seconds at `per_call`
    (at most MAX_CALLS): a few hundred calls of a few microseconds are over
    in a millisecond, where one scheduler tick skews the mean."""
    if target <= 0:
        return iters
    return max(iters, min(MAX_CALLS, int(target / max(per_call, 1e-9))))


def seconds_per_call(allreduce: Callable[[], Any], barrier: Callable[[], Any], size: int,
                     iters: int, target: float = 0.0,
                     agree_max: Optional[Callable[[int], int]] = None) -> float:
    """This rank's mean time of `iters` calls of `allreduce` (of `size` bytes),
    after its warm-up calls and a barrier; every implementation is timed so.
    With `target` seconds, the warm-up goes on in doubling runs of calls
    (PROBE_CALLS first) until the ranks have warmed up for WARM_SECONDS
    (the first milliseconds after start-up run slower), and the last run's
    time per call raises the number of calls to fill `target`
    (:func:`calls_for`); the ranks agree on both through `agree_max` (the
    implementation's own allreduce, max)."""
    for _ in range(warmups_for(size)):
        allreduce()
    if target > 0 and agree_max is not None:
        start, run = time.perf_counter(), PROBE_CALLS
        while True:
            t0 = time.perf_counter()
            for _ in range(run):
                allreduce()
            now = time.perf_counter()
            if agree_max(int((now - start) * 1e6)) >= min(WARM_SECONDS, target) * 1e6:
                break
            run *= 2
        iters = agree_max(calls_for((now - t0) / run, iters, target))
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        allreduce()
    return (time.perf_counter() - t0) / iters


# ---------------------------------------------------------------- workers

def worker_ember(rank: int, addresses: List[str], fd: int, plan: List[List[int]],
                 tcp_only: bool) -> None:
    sys.path.insert(0, os.path.join(REPO, "python"))
    from ember import _ember as E

    pin_like_mpirun(rank, len(addresses))
    comm = E.Communicator(rank, addresses, SECRET, 120.0, listen_fd=fd, tcp_only=tcp_only)
    want = "tcp" if tcp_only else "shm"
    got = [comm.transport(p) for p in range(len(addresses)) if p != rank]
    if any(t != want for t in got):  # not the transport this side stands for
        raise SystemExit("rank %d: transports %s, expected %s" % (rank, got, want))
    time_ember(comm, rank, plan)


def pin_like_mpirun(rank: int, ranks: int) -> None:
    """Binds rank r to core r when every rank has a core, as mpirun binds its
    ranks by default (--bind-to core for 2 ranks); otherwise leaves them
    unbound, as mpirun --oversubscribe does.  Unbound, two ranks can start on
    one core and spin against each other until the scheduler separates them,
    which can take longer than a small size's whole timing."""
    cores = sorted(os.sched_getaffinity(0))
    if ranks <= len(cores):
        os.sched_setaffinity(0, {cores[rank]})


def time_ember(comm: Any, rank: int, plan: List[List[int]]) -> None:
    """Times Ember's allreduce for each (size, calls) of ``plan`` on ``comm``
    (then closed); rank 0 prints the slowest rank's seconds per call, a JSON
    line per size."""
    import numpy as np

    def agree_max(x: int) -> int:
        return int(comm.allreduce(np.array([x], dtype=np.float64), "max")[0])

    for size, iters, *target in plan:
        a = np.ones(size // 4, dtype=np.float32)
        dt = np.array([seconds_per_call(lambda: comm.allreduce(a), comm.barrier, size, iters,
                                        target[0] if target else 0.0, agree_max)])
        comm.allreduce(dt, "max")
        if rank == 0:
            print(json.dumps({"size": size, "sec": float(dt[0]),
                              "algorithm": comm.algorithm(a)}), flush=True)
    comm.close()


def worker_gloo(rank: int, world: int, init_method: str, plan: List[List[int]],
                pin: bool = False) -> None:
    """gloo's allreduce, timed as :func:`time_ember` times Ember's (``pin``:
    bound as :func:`pin_like_mpirun` binds Ember's ranks)."""
    import torch
    import torch.distributed as dist

    if pin:
        pin_like_mpirun(rank, world)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    def agree_max(x: int) -> int:
        most = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    for size, iters, *target in plan:
        t = torch.ones(size // 4, dtype=torch.float32)
        dt = torch.tensor([seconds_per_call(lambda: dist.all_reduce(t), dist.barrier, size,
                                            iters, target[0] if target else 0.0, agree_max)],
                          dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(json.dumps({"size": size, "sec": float(dt[0])}), flush=True)
    dist.destroy_process_group()


def worker_sink(port: int) -> None:
    """Loopback receiver: counts bytes until the sender closes."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    total, t0 = 0, None
    while True:
        n = conn.recv_into(view)
        if n == 0:
            break
        if t0 is None:
            t0 = time.perf_counter()
        total += n
    print(json.dumps({"bytes": total, "sec": time.perf_counter() - (t0 or 0)}), flush=True)


# ---------------------------------------------------------------- drivers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_arg(sizes: List[int], budget: int, target: float) -> str:
    """[size, least calls, target seconds (0: no probe)] per size."""
    return json.dumps([[s, iters_for(s, budget), target if s <= CALIBRATED_MAX else 0.0]
                       for s in sizes])


def collect(procs: List[subprocess.Popen], timeout: float) -> Dict[int, float]:
    out: Dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        stdout, _ = procs[0].communicate(timeout=max(1.0, deadline - time.monotonic()))
        for p in procs[1:]:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError("a rank failed (exit codes %s)" % [p.returncode for p in procs])
    for line in stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out[d["size"]] = d["sec"]
    return out


def run_ember(n: int, plan: str, tcp_only: bool, timeout: float) -> Dict[int, float]:
    sys.path.insert(0, os.path.join(REPO, "python"))
    from ember import _ember as E

    reserved = [E.reserve_port("127.0.0.1") for _ in range(n)]
    addresses = ",".join("127.0.0.1:%d" % port for _, port in reserved)
    procs = []
    for rank, (fd, _) in enumerate(reserved):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "ember", "--rank",
               str(rank), "--addresses", addresses, "--fd", str(fd),
               "--plan", plan] + (["--tcp"] if tcp_only else [])
        procs.append(subprocess.Popen(cmd, pass_fds=[fd], stdout=subprocess.PIPE, text=True))
        os.close(fd)
    return collect(procs, timeout)


def run_gloo(n: int, plan: str, python: str, timeout: float) -> Dict[int, float]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    procs = [subprocess.Popen([python, os.path.abspath(__file__), "--worker", "gloo", "--rank",
                               str(r), "--world", str(n), "--port", str(port), "--plan", plan],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(n)]
    return collect(procs, timeout)


def run_mpi(n: int, plan: str, exe: str, tcp_only: bool, timeout: float) -> Dict[int, float]:
    cmd = ["mpirun", "-np", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if tcp_only:
        cmd += ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self"]
    cmd += [exe] + [":".join(str(v) for v in step) for step in json.loads(plan)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError("mpirun failed: %s" % res.stderr[-2000:])
    out = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "mpi":
            out[int(parts[1])] = float(parts[2])
    return out


def loopback_bytes_per_sec(seconds: float) -> float:
    """One TCP stream over loopback, 4 MiB writes, for `seconds`."""
    port = free_port()
    sink = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "sink",
                             "--port", str(port)], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    sink.stdout.readline()  # "ready"
    s = socket.create_connection(("127.0.0.1", port))
    buf = memoryview(bytearray(4 << 20))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s.sendall(buf)
    s.close()
    res = json.loads(sink.stdout.readline())
    sink.wait(timeout=30)
    return res["bytes"] / res["sec"]


# ---------------------------------------------------------------- report

def _finite(xs: List[float]) -> List[float]:
    """The rounds that gave a figure: a failed launch leaves nan (or None)."""
    return [x for x in xs if x is not None and math.isfinite(x)]


def med(xs: List[float]) -> Optional[float]:
    """The median over the rounds that gave a figure; None if none did."""
    ok = _finite(xs)
    return rounds.spread(ok).median if ok else None


def cell(xs: List[float], width: int = 19) -> str:
    """median [min-max] over the rounds that gave a figure, or n/a."""
    ok = _finite(xs)
    return "%-*s" % (width, rounds.fmt_spread(ok, ".3f") if ok else "n/a")


def kv(x: Optional[float]) -> str:
    return "%.3f" % x if x is not None and math.isfinite(x) else "nan"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def main() -> int:
    quick = quick_mode()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sizes", default=QUICK_SIZES if quick else DEFAULT_SIZES)
    ap.add_argument("--rounds", type=int, default=1 if quick else 3)
    ap.add_argument("--budget", type=parse_size, default=parse_size("8M" if quick else "512M"),
                    help="bytes of buffer per size and launch (calls = budget / size, 3..200)")
    ap.add_argument("--target-seconds", type=float, default=0.005 if quick else 0.05,
                    help="sizes up to 4 MiB: at least this long per timing (more calls, "
                         "agreed by the ranks after a warm-up); 0: budget only")
    ap.add_argument("--loopback-seconds", type=float, default=0.2 if quick else 1.0)
    ap.add_argument("--mpi-exe", default=os.path.join(REPO, "build", "bench", "mpi_allreduce"))
    ap.add_argument("--gloo-python", default=sys.executable,
                    help="an interpreter that can import torch with gloo")
    ap.add_argument("--timeout", type=float, default=900.0)
    # worker modes (internal)
    ap.add_argument("--worker", choices=["ember", "gloo", "sink"])
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--addresses")
    ap.add_argument("--fd", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--plan")
    ap.add_argument("--tcp", action="store_true")
    args = ap.parse_args()

    if args.worker == "ember":
        worker_ember(args.rank, args.addresses.split(","), args.fd, json.loads(args.plan),
                     args.tcp)
        return 0
    if args.worker == "gloo":
        worker_gloo(args.rank, args.world, "tcp://127.0.0.1:%d" % args.port,
                    json.loads(args.plan), pin=True)
        return 0
    if args.worker == "sink":
        worker_sink(args.port)
        return 0

    ranks = [int(r) for r in args.ranks.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if any(s % 4 for s in sizes):
        ap.error("sizes must be multiples of 4 bytes (float32)")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    not_measured = []
    if not (os.path.exists(args.mpi_exe) and shutil.which("mpirun")):
        print("note: Open MPI (mpirun) or %s missing: Open MPI not measured" % args.mpi_exe)
        not_measured.append("mpi")
    gloo_ok = (shutil.which(args.gloo_python) or os.path.exists(args.gloo_python)) and \
        subprocess.run([args.gloo_python, "-c",
                        "import torch.distributed as d; assert d.is_gloo_available()"],
                       capture_output=True).returncode == 0
    if not gloo_ok:
        print("note: %s cannot import torch with gloo: "
              "gloo not measured" % args.gloo_python)
        not_measured.append("gloo")
    sides = [s for s in SIDES if not (s.startswith("mpi") and "mpi" in not_measured)
             and not (s == "gloo" and "gloo" in not_measured)]

    plan = plan_arg(sizes, args.budget, args.target_seconds)
    # bus[side][n][size] -> busbw (GB/s) per round; loop: loopback GB/s per round
    bus = {s: {n: {z: [] for z in sizes} for n in ranks} for s in SIDES}
    loop: List[float] = []
    launch = {
        "ember_shm": lambda n: run_ember(n, plan, False, args.timeout),
        "ember_tcp": lambda n: run_ember(n, plan, True, args.timeout),
        "mpi_shm": lambda n: run_mpi(n, plan, args.mpi_exe, False, args.timeout),
        "mpi_tcp": lambda n: run_mpi(n, plan, args.mpi_exe, True, args.timeout),
        "gloo": lambda n: run_gloo(n, plan, args.gloo_python, args.timeout),
    }
    # name -> one launch; each round runs every one (rounds.interleaved)
    jobs: Dict[str, Callable[[], None]] = {
        "loopback": lambda: loop.append(loopback_bytes_per_sec(args.loopback_seconds) / 1e9)}
    for n in ranks:
        for side in sides:
            def job(side: str = side, n: int = n) -> None:
                got = launch[side](n)
                for z in sizes:
                    sec = got.get(z)
                    bus[side][n][z].append(z * 2.0 * (n - 1) / n / sec / 1e9 if sec
                                           else float("nan"))
            jobs["%s %d ranks" % (side, n)] = job
    print("allreduce, one host: %s; ranks %s; sizes %s; %d interleaved rounds; %d CPUs"
          % (", ".join(sides), args.ranks, ",".join(human(z) for z in sizes), args.rounds,
             os.cpu_count() or 0), flush=True)
    t_start = time.monotonic()
    # the round so far: when it started, "<launch> <seconds>" for each launch
    t_round = t_start
    took: List[str] = []

    def start(r: int) -> None:
        nonlocal t_round
        t_round = time.monotonic()
        took.clear()

    def report(r: int, name: str, _: None, secs: float) -> None:
        took.append("%s %.1f" % (name.replace(" ranks", "r"), secs))

    def failed(r: int, name: str, e: Exception, secs: float) -> None:
        # one failed launch is a gap in the table, not the end
        print("round %d: %s failed: %s" % (r + 1, name, e), flush=True)
        report(r, name, None, secs)

    def end(r: int) -> None:
        print("round %d/%d: %.1f s (%s)" % (r + 1, args.rounds,
                                            time.monotonic() - t_round, ", ".join(took)),
              flush=True)

    # rotated each round so no side always goes first
    rounds.interleaved(args.rounds, jobs, start=start, report=report, failed=failed, end=end)

    print("\nfloat32 sum, in place; GB/s = 1e9 bytes/s; busbw = bytes * 2(n-1)/n / time; "
          "median [min-max] over %d rounds (%.0f s)" % (args.rounds, time.monotonic() - t_start))
    print("loopback TCP, one stream: %s GB/s" % cell(loop).strip())
    result: Dict[str, Optional[float]] = {}
    ratios: Dict[str, Dict[int, List[float]]] = {p: {n: [] for n in ranks} for _, _, p in PAIRS}
    for n in ranks:
        print("\n== %d ranks: busbw GB/s, median [min-max]" % n)
        print("%8s  " % "size" + " ".join("%-19s" % LABEL[s] for s in SIDES) +
              "  shm/ompi  tcp/ompi_tcp  tcp/gloo")
        for z in sizes:
            m = {s: med(bus[s][n][z]) for s in SIDES}
            rs = []
            for a, b, p in PAIRS:
                x = ratio(m[a], m[b])
                if x is not None:
                    ratios[p][n].append(x)
                rs.append(("%7.2fx" % x) if x is not None else "     n/a")
            print("%8s  " % human(z) + " ".join(cell(bus[s][n][z]) for s in SIDES) +
                  "  %s  %12s  %8s" % (rs[0], rs[1], rs[2]))
            for s in SIDES:
                result["%s_%dr_%s_gbs" % (s, n, human(z))] = m[s]
    print()
    head: List[str] = []
    for _, _, p in PAIRS:
        every = [x for n in ranks for x in ratios[p][n]]
        head.append("%s_min=%s" % (p, kv(min(every) if every else None)))
    for _, _, p in PAIRS:
        every = [x for n in ranks for x in ratios[p][n]]
        head.append("%s_max=%s" % (p, kv(max(every) if every else None)))
    for n in ranks:
        for _, _, p in PAIRS:
            low = min(ratios[p][n]) if ratios[p][n] else None
            head.append("%s_min_%dr=%s" % (p, n, kv(low)))
    head += ["loopback_gbs=%s" % kv(med(loop)), "rounds=%d" % args.rounds]
    tail = ["%s=%s" % (k, kv(v)) for k, v in result.items()]
    if not_measured:
        tail.append("not_measured=" + ",".join(not_measured))
    print("RESULT allreduce " + " ".join(head + tail))
    # A peer that failed is a gap in the table; Ember failing is a failed run.
    ember_missing = any(result["%s_%dr_%s_gbs" % (s, n, human(z))] is None
                        for s in ("ember_shm", "ember_tcp") for n in ranks for z in sizes)
    return 1 if ember_missing else 0


if __name__ == "__main__":
    sys.exit(main())
