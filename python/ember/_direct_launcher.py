"""What the executor JVM starts for EmberModel's direct path:
``python -m ember._direct_launcher <model path> <runtime>``.

The inference worker (:mod:`ember.ml._direct_worker`) imports TensorFlow or
torch, and Ember's ML stages, before its first batch: about 7 CPU s on a
2-core machine, paid by every worker of every executor.  This launcher,
which imports neither, has the worker forked from a fork server that
imported them already (:mod:`ember._forkserver`: one per kind, the same
servers as nodes', by program), handing it its own stdin, stdout and stderr,
which are the JVM's pipes and the worker's log.  It then stands in for the
worker: it passes a SIGTERM, SIGINT or SIGHUP on to the worker's process
group and exits with the worker's exit status.  Killed with SIGKILL, it
cannot; the JVM then closes the pipes, and the worker, at the end of its
input, exits.

The worker runs here instead, as ``python -m ember.ml._direct_worker``
would run it, when it is given GPUs, in a YARN container, with
``EMBER_FORKSERVER=0``, for a runtime this launcher does not know, or when
no server can start (see :func:`ember._forkserver.wanted`).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Dict, Tuple

#: what a worker of each runtime (EmberModel's model format) imports
RUNTIME_IMPORTS: Dict[str, Tuple[str, ...]] = {
    "savedmodel": ("tensorflow",),
    "torchscript": ("torch",),
}
WORKER = "ember.ml._direct_worker"


def main() -> int:
    from ember import _forkserver

    runtime = sys.argv[2] if len(sys.argv) > 2 else ""
    preload = RUNTIME_IMPORTS.get(runtime, ())
    gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    worker = None
    if _forkserver.wanted(preload, gpus):
        env = dict(os.environ)
        worker = _forkserver.spawn(["-m", WORKER, *sys.argv[1:]], preload, env, env, 60.0,
                                   fds=(0, 1, 2))
    if worker is None:
        from ember.ml import _direct_worker

        return _direct_worker.main()

    def pass_on(signum: int, _frame: object) -> None:
        try:
            os.killpg(worker.pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, pass_on)
    for fd in (0, 1):  # the worker's now: this process neither reads nor writes them
        os.close(fd)
    code = None
    while code is None:  # in steps, so that the handlers above run when a signal comes
        code = worker.wait(1.0)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
