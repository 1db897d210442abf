"""main_fun bodies for the collective tests on Spark (imported by node processes).

Each node writes what it observed to ``args["out"]/coll-<index>.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List

import numpy as np

from test_collective import DTYPES, OPS, _inputs, _reference

SIZES = [0, 1, 7, 4099, 70001]


def _write(args: Dict[str, Any], ctx: Any, info: Dict[str, Any]) -> None:
    path = os.path.join(args["out"], f"coll-{ctx.worker_num}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def every_op(args: Dict[str, Any], ctx: Any) -> None:
    """Every op and dtype of ctx.allreduce against numpy, then broadcast,
    allgather and barrier; the evaluator checks that it has no collective."""
    if ctx.job_name not in ("chief", "worker"):
        try:
            ctx.allreduce(np.zeros(3, np.float32))
            error = ""
        except RuntimeError as exc:
            error = str(exc)
        _write(args, ctx, dict(role=ctx.job_name, error=error))
        return
    rank, size = ctx.collective.rank, ctx.collective.size
    failures: List[str] = []
    digest = hashlib.sha256()
    for dtype in DTYPES:
        for op in OPS:
            for n in SIZES:
                a = _inputs(rank, dtype, n, seed=7)
                if ctx.allreduce(a, op=op) is not a:
                    failures.append("allreduce did not return its array")
                want = _reference(size, dtype, n, op, seed=7)
                if np.issubdtype(dtype, np.floating):
                    tol = 1e-5 if dtype == np.float32 else 1e-12
                    ok = np.allclose(a, want, rtol=tol, atol=tol)
                else:
                    ok = np.array_equal(a, want)
                if not ok:
                    failures.append(f"allreduce {np.dtype(dtype).name} {op} n={n}")
                digest.update(a.tobytes())
    for root in range(size):
        b = np.full((3, 5), rank, dtype=np.float64)
        ctx.broadcast(b, root=root)
        if not (b == root).all():
            failures.append(f"broadcast root={root}: {b.ravel()[:3]}")
    g = ctx.allgather(np.array([rank, 10 * rank + 1], np.int64))
    if g.tolist() != [[r, 10 * r + 1] for r in range(size)]:
        failures.append(f"allgather: {g.tolist()}")
    ctx.barrier()
    errors = []
    for bad in (lambda: ctx.allreduce(np.zeros(3, np.uint8)),
                lambda: ctx.allreduce(np.zeros(3, np.float32), op="prod"),
                lambda: ctx.allreduce(np.zeros((4, 4), np.float32)[:, 1]),
                lambda: ctx.broadcast(np.zeros(3), root=size)):
        try:
            bad()
            errors.append("")
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    _write(args, ctx, dict(role=ctx.job_name, rank=rank, size=size, failures=failures,
                           digest=digest.hexdigest(), rank_env=os.environ.get("RANK"),
                           errors=errors))
