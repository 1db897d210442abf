"""make bench-smoke: every benchmark at a tiny size, so that none of them rots.

Runs each ``make bench-<name>`` below, one after the other, with
EMBER_BENCH_QUICK=1 in the environment (each benchmark then only shrinks its
sizes, record counts or rounds: the same code measures the same things),
keeps its output in build/bench-smoke/<target>.log and checks that

* it exited with status 0,
* it printed a line ``RESULT <name> key=value ...`` (the last such line counts),
* every expected key below is in that line with a numeric value (inf allowed:
  a peer that did not finish; nan only where the line says that peer was not
  measured, ``not_measured=<peer>,...``, or failed, ``<peer>_error=<tag>``),
* or, for bench-cluster only, that the line says ``skipped=<why>`` (no
  network namespaces here; the benchmark prints why).

A failure names the benchmark and what is missing; every benchmark runs even
after one fails, and the exit status is 1 if any failed.

    make bench-smoke
    python bench/smoke.py --only bench-allreduce,bench-reservation
    python bench/smoke.py --make-test   # the ones make test runs (Bench.in_make_test)
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGS = os.path.join(REPO, "build", "bench-smoke")


class Bench(NamedTuple):
    target: str                  # make target
    name: str                    # RESULT <name>
    keys: Sequence[str]          # expected keys, each numeric
    # peer -> substrings of the keys that may be nan when that peer was not
    # measured (not_measured=<peer>) or failed (<peer>_error=<tag>)
    peers: Dict[str, Tuple[str, ...]] = {}
    may_skip: bool = False       # RESULT <name> skipped=<why> is a pass
    # make test runs this one's smoke run too (tests/stages.py, --make-test).
    # The four that start Spark applications, TensorFlow processes and each
    # peer's own cluster for every side (ps, train, feed, inference) took 706
    # of the 900 s the ten took beside the compatibility subset, which would
    # put make test over its 45-minute ceiling: they run in make bench-smoke
    # only, which a change to bench/ or to the paths they drive runs.
    in_make_test: bool = True


BENCHES: List[Bench] = [
    Bench("bench-reservation", "reservation",
          ["n", "ratio", "ember_s", "ember_min_s", "ember_max_s", "tfos_s", "tfos_min_s",
           "tfos_max_s", "trials", "ember_server_s"],
          {"tfos": ("tfos_",)}),
    Bench("bench-tfrecord", "tfrecord",
          ["ember_gbps", "tfdata_gbps", "ratio_vs_tfdata", "crc_gbps", "crc_limit_gbps",
           "ember_gbps_min", "ember_gbps_max", "tfdata_gbps_min", "tfdata_gbps_max", "rounds"]),
    Bench("bench-allreduce", "allreduce",
          ["shm_vs_ompi_min", "tcp_vs_ompi_tcp_min", "tcp_vs_gloo_min",
           "shm_vs_ompi_max", "tcp_vs_ompi_tcp_max", "tcp_vs_gloo_max",
           "shm_vs_ompi_min_2r", "tcp_vs_ompi_tcp_min_2r", "tcp_vs_gloo_min_2r",
           "shm_vs_ompi_min_4r", "tcp_vs_ompi_tcp_min_4r", "tcp_vs_gloo_min_4r",
           "loopback_gbs", "rounds"],
          {"mpi": ("ompi",), "gloo": ("gloo",)}),
    Bench("bench-cluster", "bench-cluster",
          ["vs_best_min", "vs_best_min_2r", "vs_best_min_4r", "vs_stream_2r_max",
           "vs_stream_4r_max", "vs_streams_2r_max", "vs_streams_4r_max", "stream_gbs",
           "streams_2r_gbs", "streams_4r_gbs", "feed_tcp_gbs", "feed_vs_stream",
           "feed_enc_vs_clear", "allreduce_enc_vs_clear", "feed_enc_vs_clear_10g",
           "allreduce_enc_vs_clear_10g"],
          {"mpi": ("vs_best",), "gloo": ("vs_best",)}, may_skip=True),
    Bench("bench-ps", "ps",
          ["dense_vs_best", "sparse_vs_best", "dense_vs_best_1ps", "dense_vs_best_2ps",
           "sparse_vs_best_1ps", "sparse_vs_best_2ps"] +
          ["%s_%s_%s_%dps" % (side, w, unit, n) for side in ("ember", "tf", "torch")
           for w in ("dense", "sparse") for unit in ("rps", "gbps") for n in (1, 2)] +
          ["link_gbit", "rounds", "workers", "ps_min", "ps_max", "widedeep_async_rps",
           "widedeep_sync_rps", "widedeep_async_vs_sync"],
          {"tf": ("tf_", "vs_best"), "torch": ("torch_", "vs_best")}, in_make_test=False),
    Bench("bench-train", "train",
          ["vs_limit", "vs_tfos", "vs_torchdistributor", "vs_limit_tf", "steady_vs_tfos",
           "steady_vs_torchdistributor"] +
          ["%s_%s" % (side, k) for side in ("ember_spark", "ember_tf", "limit", "tfos",
                                            "ember_torch", "torchdistributor")
           for k in ("e2e_s", "rps", "acc")] + ["records", "epochs", "rounds"],
          {"tfos": ("tfos",), "torchdistributor": ("torchdistributor",)}, in_make_test=False),
    Bench("bench-tf-feed", "tf_feed",
          ["op_vs_generator", "op_vs_limit", "op_rps", "generator_rps", "limit_rps", "records",
           "batch", "rounds"]),
    Bench("bench-feed-channel", "feed_channel",
          ["feed_shm_vs_memcpy", "feed_tcp_vs_memcpy", "channel_vs_memcpy", "channel_gbps",
           "feed_shm_gbps", "feed_tcp_gbps", "memcpy_gbps"]),
    Bench("bench-feed", "feed",
          ["rdd_vs_spark_rdd", "rdd_vs_tfos", "tensor_vs_spark_arrow_tensor",
           "df_vs_spark_arrow", "ember_rdd_rps", "tfos_rps", "channel_gbps"],
          {"tfos": ("tfos",)}, in_make_test=False),
    Bench("bench-inference", "inference",
          ["ember_rps", "pbu_rps", "tfos_rps", "ratio_vs_pbu", "ratio_vs_tfos",
           "ember_udf_rps", "noop_udf_rps", "ratio_vs_noop_udf", "ember_rps_min", "ember_rps_max",
           "pbu_rps_min", "pbu_rps_max", "tfos_rps_min", "tfos_rps_max", "rounds"],
          {"tfos": ("tfos",), "pbu": ("pbu",)}, in_make_test=False),
]


def result_line(output: str, name: str) -> Optional[str]:
    found = None
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "RESULT" and parts[1] == name:
            found = line.strip()
    return found


def check(b: Bench, rc: int, output: str) -> Tuple[bool, str]:
    """(passed, what to say)."""
    line = result_line(output, b.name)
    if line is None:
        return False, "no 'RESULT %s ...' line (exit status %d)" % (b.name, rc)
    kv: Dict[str, str] = {}
    for tok in line.split()[2:]:
        if "=" in tok:
            k, v = tok.split("=", 1)
            kv[k] = v
    if b.may_skip and "skipped" in kv:
        return rc == 0, "skipped: %s (exit status %d)" % (kv["skipped"], rc)
    if rc != 0:
        return False, "exit status %d" % rc
    unmeasured = set(kv.get("not_measured", "").split(",")) - {""}
    unmeasured |= {p for p in b.peers if "%s_error" % p in kv}
    excused = [s for p in unmeasured for s in b.peers.get(p, ())]
    missing, bad = [], []
    for k in b.keys:
        if k not in kv:
            missing.append(k)
            continue
        try:
            x = float(kv[k])
        except ValueError:
            x = math.nan
        if math.isnan(x) and not any(s in k for s in excused):
            bad.append("%s=%s" % (k, kv[k]))
    if missing or bad:
        return False, "; ".join((["missing key(s): " + ", ".join(missing)] if missing else []) +
                                (["not numeric: " + ", ".join(bad)] if bad else []))
    if unmeasured:
        return True, "%d expected keys present; nan allowed for %s (not measured or failed)" % (
            len(b.keys), ",".join(sorted(unmeasured)))
    return True, "%d expected keys, all numeric" % len(b.keys)


def run(b: Bench, timeout: float) -> Tuple[int, str, float]:
    os.makedirs(LOGS, exist_ok=True)
    env = dict(os.environ, EMBER_BENCH_QUICK="1", PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    try:
        p = subprocess.run(["make", "--no-print-directory", b.target], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace", timeout=timeout)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        rc, out = 124, out + "\n[bench-smoke: killed after %.0f s]\n" % timeout
    secs = time.monotonic() - t0
    with open(os.path.join(LOGS, b.target + ".log"), "w") as f:
        f.write(out)
    return rc, out, secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated make targets (default: all)")
    ap.add_argument("--make-test", action="store_true",
                    help="only the benchmarks make test runs (in_make_test)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per benchmark")
    args = ap.parse_args()
    only = [t for t in args.only.split(",") if t]
    unknown = set(only) - {b.target for b in BENCHES}
    if unknown:
        ap.error("unknown target(s): %s" % ", ".join(sorted(unknown)))
    benches = [b for b in BENCHES if (not only or b.target in only)
               and (b.in_make_test or not args.make_test)]

    t_all = time.monotonic()
    rows = []
    for b in benches:
        print("== %s (EMBER_BENCH_QUICK=1) ..." % b.target, flush=True)
        rc, out, secs = run(b, args.timeout)
        ok, why = check(b, rc, out)
        line = result_line(out, b.name)
        print("   %s in %.1f s: %s" % ("ok" if ok else "FAILED", secs, why), flush=True)
        if line:
            print("   " + line, flush=True)
        if not ok:
            tail = out.rstrip().splitlines()[-40:]
            print("   --- last %d lines of build/bench-smoke/%s.log:" % (len(tail), b.target))
            for ln in tail:
                print("   | " + ln)
        rows.append((b.target, ok, secs, why))
    total = time.monotonic() - t_all
    print("\nbench-smoke summary (EMBER_BENCH_QUICK=1; logs in build/bench-smoke/):")
    for target, ok, secs, why in rows:
        print("  %-20s %-6s %6.1f s  %s" % (target, "ok" if ok else "FAILED", secs, why))
    failed = [t for t, ok, _, _ in rows if not ok]
    what = ("failed: " + ", ".join(failed)) if failed else "%d benchmarks" % len(rows)
    print("  %-20s %-6s %6.1f s  %s" % ("total", "FAILED" if failed else "ok", total, what))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
