"""Interleaved rounds and their median [min-max], shared by the benchmarks.

A benchmark compares sides (Ember and its peers) on one shared machine, whose
load comes and goes.  So no side's runs are done in one block: every round
runs every side once, the order rotated from round to round so that no side
always goes first (with two sides: alternately), and each side is reported
as the median of its rounds with their [min-max].

    got = interleaved(3, {"a": run_a, "b": run_b})  # runs a b, b a, a b
    print(fmt_spread(got["a"], ".2f"))              # 2.00 [1.00-3.00]

Every bench/*.py script runs with bench/ on sys.path, so each imports this
module as ``rounds``.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, TypeVar

T = TypeVar("T")


def interleaved(rounds: int, sides: Mapping[str, Callable[[], T]], *,
                start: Optional[Callable[[int], None]] = None,
                report: Optional[Callable[[int, str, T, float], None]] = None,
                failed: Optional[Callable[[int, str, Exception, float], None]] = None,
                end: Optional[Callable[[int], None]] = None) -> Dict[str, List[T]]:
    """Runs every one of ``sides`` once per round, ``rounds`` times; round r
    (from 0) starts at the r-th side (mod their number) and goes on in the
    mapping's order, wrapping around.

    Parameters
    ----------
    rounds : int
        how many rounds.
    sides : Mapping[str, Callable[[], T]]
        name -> a call that runs that side once and returns its result.
    start : callable, optional
        ``start(r)`` before round r's first call.
    report : callable, optional
        ``report(r, name, result, seconds)`` after each call that returned;
        seconds is the call's wall time (time.perf_counter).
    failed : callable, optional
        ``failed(r, name, exception, seconds)`` after each call that raised an
        Exception; the rounds then go on (that round is a gap in the side's
        results).  Without it the exception propagates.
    end : callable, optional
        ``end(r)`` after round r's last call.

    Returns
    -------
    dict
        name -> the side's results in round order, the names in ``sides``'s
        order whatever order they ran in (the benchmarks' tables follow it).
    """
    names = list(sides)
    out: Dict[str, List[T]] = {name: [] for name in names}
    for r in range(rounds):
        if start is not None:
            start(r)
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            try:
                result = sides[name]()
            except Exception as e:
                if failed is None:
                    raise
                failed(r, name, e, time.perf_counter() - t0)
                continue
            secs = time.perf_counter() - t0
            out[name].append(result)
            if report is not None:
                report(r, name, result, secs)
        if end is not None:
            end(r)
    return out


class Spread(NamedTuple):
    """The median of a side's rounds and their range."""
    median: float
    min: float
    max: float


def spread(values: Iterable[float]) -> Spread:
    """(median, min, max) of ``values``; ValueError if there are none."""
    xs = list(values)
    if not xs:
        raise ValueError("spread of no values")
    return Spread(statistics.median(xs), min(xs), max(xs))


def fmt_range(values: Iterable[float], spec: str, sep: str = "-") -> str:
    """``[min-max]`` of ``values``, each formatted with ``spec`` (a format
    spec such as ``".3f"`` or ``",.0f"``), ``sep`` between them: for tables
    whose median has a column of its own."""
    return _range(spread(values), spec, sep)


def fmt_spread(values: Iterable[float], spec: str) -> str:
    """``median [min-max]`` of ``values``, each formatted with ``spec``,
    e.g. ``fmt_spread(xs, ".3f")`` -> ``"1.250 [1.100-1.400]"``."""
    s = spread(values)
    return f"{s.median:{spec}} {_range(s, spec, '-')}"


def _range(s: Spread, spec: str, sep: str) -> str:
    return f"[{s.min:{spec}}{sep}{s.max:{spec}}]"
