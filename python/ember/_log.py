"""Ember's logging: loggers per module under ``ember``, and the one handler Ember may add.

Every module logs through ``logging.getLogger("ember.<module>")``
(``ember.spark``, ``ember.node``, ``ember.ml``, ``ember.yarn``,
``ember.compat.tfos``, ``ember.mlflow``...); a user sets the level and the
handlers with the standard :mod:`logging` API, e.g.
``logging.getLogger("ember").setLevel(logging.WARNING)``.

Library code adds no handler, with one exception: the entry points of a job
(:func:`ember.spark.run`, :func:`ember.yarn.run_on_yarn`, the ``ember``
command), the processes Ember starts itself (a node, a YARN task) and the
Spark Python workers where EmberModel's inference binds a task's GPUs (no
application configures logging there) call :func:`default_handler`, which,
when the root logger has no handler (nothing configured logging), installs
ONE handler on the ``ember`` logger: stderr, :data:`FORMAT`, level INFO.  So a program that configured
nothing still sees a job's progress, and one that configured logging sees
Ember's lines where it sends the rest.  The handler steps aside once the
root logger has handlers of its own (configured later, say by ``main_fun``),
so no line is ever written twice.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["FORMAT", "default_handler"]

#: The format of the handler :func:`default_handler` installs.
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _DefaultHandler(logging.StreamHandler):
    """Ember's stderr handler; writes nothing once the root logger has handlers."""

    def __init__(self, fmt: str) -> None:
        super().__init__()  # sys.stderr, looked up at each write (pytest swaps it)
        self.setFormatter(logging.Formatter(fmt))

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the application configured logging: its handlers have the record
        super().emit(record)


def default_handler(process: str = "") -> None:
    """Installs Ember's stderr handler (:data:`FORMAT`, INFO) on the ``ember``
    logger when the root logger has no handlers and it is not there yet; sets
    the ``ember`` logger's level to INFO unless it has one.  Idempotent; does
    nothing in a program that configured logging.

    ``process`` names the process in every line (``[node 1]``): a node's lines
    reach the executor's stderr beside other nodes' and Spark's own."""
    ember = logging.getLogger("ember")
    if logging.getLogger().handlers or any(isinstance(h, _DefaultHandler)
                                           for h in ember.handlers):
        return
    fmt = FORMAT.replace("%(name)s:", f"%(name)s [{process}]:") if process else FORMAT
    ember.addHandler(_DefaultHandler(fmt))
    if ember.level == logging.NOTSET:
        ember.setLevel(logging.INFO)
