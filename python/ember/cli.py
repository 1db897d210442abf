"""The ``ember`` command line (the ``ember`` console script, or ``python -m ember``).

``ember version``: Ember's version.  ``ember doctor``: checks this installation
(see :mod:`ember.doctor`).

``ember tfrecord inspect FILE``: record count, per-feature schema, the first
records, and, for a corrupt or truncated file, the error with its byte offset
(exit status 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, List, Optional


def _fmt_values(v: List[Any], limit: int = 8) -> str:
    shown = [x.decode("utf-8", "backslashreplace") if isinstance(x, bytes) and len(x) <= 64
             else (f"<{len(x)} bytes>" if isinstance(x, bytes) else x) for x in v[:limit]]
    more = f", ... ({len(v)} values)" if len(v) > limit else ""
    return "[" + ", ".join(repr(x) if isinstance(x, str) else f"{x:g}" if isinstance(x, float)
                           else str(x) for x in shown) + more + "]"


def tfrecord_inspect(args: argparse.Namespace) -> int:
    from ember import tfrecord

    comp = {"auto": "auto", "none": None, "gzip": "gzip", "zlib": "zlib"}[args.compression]
    status = 0
    for path in args.files:
        try:
            info = tfrecord.inspect(path, args.records, comp, args.skip_corrupt)
        except OSError as e:
            print(f"{path}: {e}", file=sys.stderr)
            status = 1
            continue
        if args.json:
            print(json.dumps(info, default=str))
        else:
            print(f"{path}: {info['records']} records, {info['data_bytes']} data bytes, "
                  f"compression {info['compression']}")
            if info["skipped"]:
                print(f"  skipped {info['skipped']} corrupt spot(s), "
                      f"{info['skipped_bytes']} bytes")
            print("  schema:")
            for name, s in sorted(info["features"].items()):
                count = str(s["min"]) if s["min"] == s["max"] else f"{s['min']}..{s['max']}"
                print(f"    {name}: {s['kind']}, {count} value(s), in {s['present']} record(s)")
            for i, rec in enumerate(info["first"]):
                print(f"  record {i}:")
                for name, v in sorted(rec.items()):
                    print(f"    {name}: {_fmt_values(v)}")
        if info["error"]:
            print(f"{path}: CORRUPT: {info['error']}", file=sys.stderr)
            status = 1
    return status


def _yarn_check(args: Any) -> int:
    """``ember yarn check``: each step of :func:`ember.yarn.check`, a line each."""
    from ember.yarn import check

    steps = check(args.conf_dir, container=not args.no_container)
    for s in steps:
        print(f"[{'ok' if s.ok else 'FAILED'}] {s.name}: {s.detail}", flush=True)
    return 0 if steps and all(s.ok for s in steps) else 1


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the CLI; returns the exit status."""
    from ember import _log

    _log.default_handler()  # what the commands log (HDFS, YARN) goes to stderr
    p = argparse.ArgumentParser(prog="ember", description="Ember command line")
    sub = p.add_subparsers(dest="command", required=True)
    tfr = sub.add_parser("tfrecord", help="TFRecord files").add_subparsers(
        dest="action", required=True)
    ins = tfr.add_parser("inspect", help="count, schema and first records of TFRecord files")
    ins.add_argument("files", nargs="+", metavar="FILE")
    ins.add_argument("-n", "--records", type=int, default=3, help="records to show (3)")
    ins.add_argument("--compression", choices=["auto", "none", "gzip", "zlib"], default="auto")
    ins.add_argument("--skip-corrupt", action="store_true",
                     help="skip and count corrupt records instead of stopping")
    ins.add_argument("--json", action="store_true", help="one JSON object per file")
    ins.set_defaults(func=tfrecord_inspect)
    yarn = sub.add_parser("yarn", help="Hadoop/YARN").add_subparsers(dest="action",
                                                                    required=True)
    chk = yarn.add_parser("check", help="check HADOOP_CONF_DIR, HDFS read/write, the "
                          "ResourceManager and a one-container round trip")
    chk.add_argument("--conf-dir", default=None, help="instead of $HADOOP_CONF_DIR")
    chk.add_argument("--no-container", action="store_true",
                     help="skip the Spark-on-YARN container round trip")
    chk.set_defaults(func=_yarn_check)
    sub.add_parser("version", help="print Ember's version").set_defaults(
        func=lambda a: __import__("ember.doctor", fromlist=["version_main"]).version_main(a))
    sub.add_parser("doctor", help="check this installation (extension, Java, Spark, "
                   "TensorFlow/PyTorch, Hadoop configuration) and say what to fix"
                   ).set_defaults(
        func=lambda a: __import__("ember.doctor", fromlist=["doctor_main"]).doctor_main(a))
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
