"""Allreduce on one host: Ember vs Open MPI (TCP only, and its defaults with
shared memory) vs torch.distributed gloo, and the loopback TCP limit, all
measured in the same run.

    make bench-allreduce            # 2 and 4 ranks, 4 KiB .. 256 MiB
    python bench/allreduce.py --ranks 2 --sizes 1M,64M   # a subset

Every implementation runs the same loop: float32 sum, in place; per size a
warm-up, a barrier, `iters` calls, and the slowest rank's mean time per call.
algbw = bytes / time; busbw = algbw * 2(n-1)/n (nccl-tests' definition: the
bandwidth each rank's link must carry for a ring allreduce).  GB/s are 10^9
bytes per second; the loopback figure is also given in Gbit/s.

Peers: Open MPI from Debian (openmpi-bin; bench/mpi_allreduce.c compiled with
mpicc, run with mpirun's default process binding), gloo through Debian's
python3-torch (CPU-only torch 1.13 with Debian's libgloo) run by the system
interpreter (--gloo-python), because the PyPI torch wheel cannot be imported
without its multi-GB CUDA dependencies.  Ember runs twice: with its defaults
(shared memory between ranks on one host) and TCP only.

The last line is
RESULT allreduce ranks=2 size=64MiB ember_busbw=<GB/s> mpi_tcp_busbw=<GB/s>
  mpi_default_busbw=<GB/s> gloo_busbw=<GB/s> loopback_gbps=<Gbit/s>
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = b"ember-bench-allreduce-secret-32b"
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"


def parse_size(s: str) -> int:
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def human(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return "%d%s" % (n // k, unit)
    return "%dB" % n


def iters_for(size: int) -> int:
    return max(3, min(200, (512 << 20) // size))


def warmups_for(size: int) -> int:
    return 1 if size >= (64 << 20) else 2


def seconds_per_call(allreduce: Callable[[], Any], barrier: Callable[[], Any], size: int,
                     iters: int) -> float:
    """This rank's mean time of `iters` calls of `allreduce` (of `size` bytes),
    after its warm-up calls and a barrier; every implementation is timed so."""
    for _ in range(warmups_for(size)):
        allreduce()
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        allreduce()
    return (time.perf_counter() - t0) / iters


# ---------------------------------------------------------------- workers

def worker_ember(rank: int, addresses: List[str], fd: int, sizes: List[int],
                 tcp_only: bool) -> None:
    sys.path.insert(0, os.path.join(REPO, "python"))
    import numpy as np
    from ember import _ember as E

    comm = E.Communicator(rank, addresses, SECRET, 120.0, listen_fd=fd, tcp_only=tcp_only)
    for size in sizes:
        a = np.ones(size // 4, dtype=np.float32)
        dt = np.array([seconds_per_call(lambda: comm.allreduce(a), comm.barrier, size,
                                        iters_for(size))])
        comm.allreduce(dt, "max")
        if rank == 0:
            print(json.dumps({"size": size, "sec": float(dt[0])}), flush=True)
    comm.close()


def worker_gloo(rank: int, world: int, port: int, sizes: List[int]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world)
    for size in sizes:
        t = torch.ones(size // 4, dtype=torch.float32)
        dt = torch.tensor([seconds_per_call(lambda: dist.all_reduce(t), dist.barrier, size,
                                            iters_for(size))], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(json.dumps({"size": size, "sec": float(dt[0])}), flush=True)
    dist.destroy_process_group()


def worker_sink(port: int, seconds: float) -> None:
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
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError("a rank failed (exit codes %s)" % [p.returncode for p in procs])
    for line in stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out[d["size"]] = d["sec"]
    return out


def run_ember(n: int, sizes: List[int], tcp_only: bool, timeout: float) -> Dict[int, float]:
    sys.path.insert(0, os.path.join(REPO, "python"))
    from ember import _ember as E

    reserved = [E.reserve_port("127.0.0.1") for _ in range(n)]
    addresses = ",".join("127.0.0.1:%d" % port for _, port in reserved)
    procs = []
    for rank, (fd, _) in enumerate(reserved):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "ember", "--rank",
               str(rank), "--addresses", addresses, "--fd", str(fd),
               "--sizes", ",".join(map(str, sizes))] + (["--tcp"] if tcp_only else [])
        procs.append(subprocess.Popen(cmd, pass_fds=[fd], stdout=subprocess.PIPE, text=True))
        os.close(fd)
    return collect(procs, timeout)


def run_gloo(n: int, sizes: List[int], python: str, timeout: float) -> Dict[int, float]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    procs = [subprocess.Popen([python, os.path.abspath(__file__), "--worker", "gloo", "--rank",
                               str(r), "--world", str(n), "--port", str(port), "--sizes",
                               ",".join(map(str, sizes))],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(n)]
    return collect(procs, timeout)


def run_mpi(n: int, sizes: List[int], exe: str, tcp_only: bool,
            timeout: float) -> Dict[int, float]:
    cmd = ["mpirun", "-np", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if tcp_only:
        cmd += ["--mca", "btl", "tcp,self"]
    cmd += [exe] + ["%d:%d" % (s, iters_for(s)) for s in sizes]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError("mpirun failed: %s" % res.stderr[-2000:])
    out = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "mpi":
            out[int(parts[1])] = float(parts[2])
    return out


def loopback_bytes_per_sec(seconds: float = 2.0) -> float:
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


def fmt(x: Optional[float]) -> str:
    return "%8.3f" % x if x is not None and math.isfinite(x) else "     n/a"


def ratio(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or not (b > 0):
        return "   n/a"
    return "%5.2fx" % (a / b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--mpi-exe", default=os.path.join(REPO, "build", "bench", "mpi_allreduce"))
    ap.add_argument("--gloo-python", default="/usr/bin/python3",
                    help="an interpreter that can import torch with gloo (Debian python3-torch)")
    ap.add_argument("--timeout", type=float, default=900.0)
    # worker modes (internal)
    ap.add_argument("--worker", choices=["ember", "gloo", "sink"])
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--addresses")
    ap.add_argument("--fd", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--tcp", action="store_true")
    args = ap.parse_args()

    if args.worker == "ember":
        worker_ember(args.rank, args.addresses.split(","), args.fd,
                     [int(s) for s in args.sizes.split(",")], args.tcp)
        return 0
    if args.worker == "gloo":
        worker_gloo(args.rank, args.world, args.port, [int(s) for s in args.sizes.split(",")])
        return 0
    if args.worker == "sink":
        worker_sink(args.port, 0)
        return 0

    ranks = [int(r) for r in args.ranks.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if any(s % 4 for s in sizes):
        ap.error("sizes must be multiples of 4 bytes (float32)")
    have_mpi = os.path.exists(args.mpi_exe) and shutil.which("mpirun") is not None
    gloo_ok = subprocess.run([args.gloo_python, "-c",
                              "import torch.distributed as d; assert d.is_gloo_available()"],
                             capture_output=True).returncode == 0 \
        if shutil.which(args.gloo_python) or os.path.exists(args.gloo_python) else False
    if not have_mpi:
        print("note: Open MPI or %s missing: MPI columns are n/a" % args.mpi_exe)
    if not gloo_ok:
        print("note: %s cannot import torch with gloo (apt-get install python3-torch): "
              "gloo columns are n/a" % args.gloo_python)

    loop = loopback_bytes_per_sec()
    print("loopback TCP, one stream: %.3f GB/s = %.2f Gbit/s" % (loop / 1e9, loop * 8 / 1e9))
    print("float32 sum, in place; GB/s = 1e9 bytes/s; busbw = algbw * 2(n-1)/n\n")

    headline: Dict[str, Optional[float]] = {}
    for n in ranks:
        res: Dict[str, Dict[int, float]] = {}
        res["ember"] = run_ember(n, sizes, False, args.timeout)
        res["ember_tcp"] = run_ember(n, sizes, True, args.timeout)
        if have_mpi:
            res["mpi_tcp"] = run_mpi(n, sizes, args.mpi_exe, True, args.timeout)
            res["mpi_default"] = run_mpi(n, sizes, args.mpi_exe, False, args.timeout)
        if gloo_ok:
            res["gloo"] = run_gloo(n, sizes, args.gloo_python, args.timeout)
        names = ["ember", "ember_tcp", "mpi_tcp", "mpi_default", "gloo"]
        k = 2.0 * (n - 1) / n
        print("== %d ranks: busbw GB/s (algbw = busbw / %.2f)" % (n, k))
        print("%8s " % "size" + " ".join("%11s" % x for x in names) +
              "   ember/mpi_tcp ember/mpi_default ember/gloo ember_tcp/mpi_tcp "
              "ember_tcp/gloo ember_tcp/loopback")
        for s in sizes:
            bus = {x: (s / res[x][s] / 1e9 * k if x in res and s in res[x] else None)
                   for x in names}
            print("%8s " % human(s) + " ".join("   %s" % fmt(bus[x]) for x in names) +
                  "   %13s %17s %10s %17s %14s %18s" % (
                      ratio(bus["ember"], bus["mpi_tcp"]),
                      ratio(bus["ember"], bus["mpi_default"]),
                      ratio(bus["ember"], bus["gloo"]),
                      ratio(bus["ember_tcp"], bus["mpi_tcp"]),
                      ratio(bus["ember_tcp"], bus["gloo"]),
                      ratio(bus["ember_tcp"], loop / 1e9)))
            if n == 2 and s == 64 << 20:
                headline = bus
        print()
    def kv(x: Optional[float]) -> str:
        return "%.3f" % x if x is not None else "nan"
    print("RESULT allreduce ranks=2 size=64MiB ember_busbw=%s mpi_tcp_busbw=%s "
          "mpi_default_busbw=%s gloo_busbw=%s loopback_gbps=%.2f" % (
              kv(headline.get("ember")), kv(headline.get("mpi_tcp")),
              kv(headline.get("mpi_default")), kv(headline.get("gloo")), loop * 8 / 1e9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
