"""Ember's exceptions: one base, :class:`EmberError`, from which every Ember
exception derives, so ``except EmberError`` catches any of them.

The hierarchy::

    EmberError                          the base; also a failed libember call (.code, .name)
    ├── EmberTimeout (TimeoutError)     a libember wait ran past its timeout
    ├── EmberAuthError                  a peer did not prove the job secret
    ├── EmberAborted                    aborted by the peer or a stop request
    ├── EmberCorruptError (ValueError)  malformed TFRecord bytes
    ├── EmberSchemaError (ValueError)   a record that does not match its spec
    ├── EmberFileNotFoundError (FileNotFoundError)  an HDFS path is missing
    ├── EmberPermissionError (PermissionError)      HDFS refused the access
    ├── EmberFeedError (ValueError)     input the feed cannot carry
    ├── EmberNodeError (RuntimeError)   a node failed, exited or was lost
    ├── FeedProducerError (RuntimeError)  a feeding task failed (``on_producer_error="raise"``)
    ├── EmberJobError (RuntimeError)    Spark aborted one of Ember's jobs (a task crashed...)
    ├── ModelInputError (ValueError)    the DataFrame, mappings and model do not fit together
    ├── SparkVersionError (RuntimeError)  needs a later Spark, or Ember's jar built for this one
    └── RunFailed (RuntimeError)        every attempt of ``run_on_yarn`` failed

The C extension raises ``EmberError`` and its first seven subclasses; it takes
this very class as its base when it loads (``ember._ember.EmberError is
ember.errors.EmberError``).  Errors raised by the extension carry ``.code``,
the negative ``EMBER_E*`` status, and ``.name``, its symbolic name; those of
the Python layer have None for both (:func:`from_core` tells them apart).
Each class keeps the builtin base it had before the hierarchy existed, so
code that caught ``ValueError`` or ``RuntimeError`` still does.  The classes
are also importable where they were before (``ember.spark.EmberNodeError``,
``ember.ml.ModelInputError``, ``ember.node.FeedProducerError``,
``ember.yarn.RunFailed``, ``ember._ember.EmberTimeout``...).
"""

from __future__ import annotations

import re
import time
from typing import Any, Dict, List, Optional

__all__ = ["EmberError", "EmberFeedError", "EmberNodeError", "FeedProducerError",
           "ModelInputError", "RunFailed", "EmberTimeout", "EmberAuthError", "EmberAborted",
           "EmberCorruptError", "EmberSchemaError", "EmberFileNotFoundError",
           "EmberPermissionError", "EmberJobError", "SparkVersionError", "find_feed_error",
           "spark_job_cause",
           "from_core",
           "in_context"]

#: The subclasses the C extension defines, importable from here too.
_CORE_CLASSES = ("EmberTimeout", "EmberAuthError", "EmberAborted", "EmberCorruptError",
                 "EmberSchemaError", "EmberFileNotFoundError", "EmberPermissionError")


class EmberError(Exception):
    """The base of every Ember exception; raised as such by a libember call that
    failed (the message is libember's detailed last error).

    .. attribute:: code

        The negative ``EMBER_E*`` status of the libember call that failed;
        None for an error of Ember's Python layer.

    .. attribute:: name

        ``code``'s symbolic name (``"EMBER_ETIMEDOUT"``), or None.
    """

    code: Optional[int] = None
    name: Optional[str] = None


def from_core(exc: BaseException) -> bool:
    """True when ``exc`` was raised by a libember call (the C extension): an
    :class:`EmberError` with a ``code``, not an error of the Python layer."""
    return isinstance(exc, EmberError) and exc.code is not None


def in_context(exc: EmberError, context: str) -> EmberError:
    """A copy of a libember error ``exc``, of its class and with its ``code``
    and ``name``, whose message starts with ``context`` (raise it ``from exc``)."""
    err = type(exc)(f"{context}: {exc}")
    err.code, err.name = exc.code, exc.name
    return err


class EmberFeedError(EmberError, ValueError):
    """Input the feed cannot carry: a null, a record of another type or shape
    than the records before it, a column type the feed does not know.

    The message names the feeding task's partition, the column and the record
    (for a DataFrame, the row of the partition), e.g. ``feeding partition 3:
    column 1 ('label'): record 17 is str ('cat'), earlier records are int``.
    Such an error is deterministic: Spark's retry of the task would fail the
    same way, so ``Cluster.train`` raises it as soon as the first feeding task
    reports it (chained to Spark's exception when Spark's came first).
    A ``ValueError``, so code that caught the conversion's ``ValueError`` still
    does.
    """


#: How a collective (and the feed) words a peer that vanished mid-operation:
#: a node failing with it is more likely the casualty of another node's loss
#: than its cause.
PEER_VANISHED = "failed, was killed or left)"

#: How the frameworks word the same: TensorFlow's collectives (MultiWorker-
#: MirroredStrategy) abort every later op once a peer is gone, and gloo
#: (torch.distributed) sees the peer's connection close.
FRAMEWORK_PEER_VANISHED = ("Collective ops is aborted by", "Restart your program to reset",
                           "Connection closed by peer")


class EmberNodeError(EmberError, RuntimeError):
    """A node failed (its main_fun raised, it exited, or it was lost); raised on
    the driver by ``Cluster.train``, ``inference`` waits and ``shutdown``, with
    the node's traceback in the message.

    :param message: what happened, and the node's traceback.
    :param node: the node's index.
    :param kind: ``"failed"`` (main_fun raised or the node exited) or ``"lost"``.
    """

    def __init__(self, message: str, node: int, kind: str = "failed") -> None:
        super().__init__(message)
        self.node = node
        self.kind = kind  #: "failed" (main_fun raised or the node exited) or "lost"
        self.seen_at = time.monotonic()  #: when the driver learnt of it (time.monotonic)

    @property
    def peer_vanished(self) -> bool:
        """True when the node failed only because a peer vanished under it."""
        text = str(self)
        return self.kind == "failed" and any(
            marker in text for marker in (PEER_VANISHED, *FRAMEWORK_PEER_VANISHED))


class FeedProducerError(EmberError, RuntimeError):
    """A feeding task failed; raised by ``DataFeed.next_batch`` when the feed was
    made with ``on_producer_error="raise"``."""


class EmberJobError(EmberError, RuntimeError):
    """Spark aborted a job of Ember's (a feeding or inference task crashed or
    raised, an executor was lost, the job was cancelled) and no node failure
    explains it.  The message starts with the cause in one line, e.g.
    ``train call 1: feeding task 3 of stage 7.0 failed on executor 1 (host w2), 1
    attempt(s): Python worker exited unexpectedly (crashed)`` or
    ``inference call 2: job 9 was cancelled (part of cancelled job group
    ...)``, then the failing task's traceback where Spark gave one; Spark's
    exception, with its Java trace, is chained (``__cause__``).  Raised by
    ``train()``, and by the actions on ``inference()``'s RDD (it is lazy)."""


class ModelInputError(EmberError, ValueError):
    """The DataFrame, the mappings or the model do not fit together
    (:mod:`ember.ml`)."""


class SparkVersionError(EmberError, RuntimeError):
    """The running Spark cannot do what was asked: the feature needs a later
    Spark (the message names the feature and the version), or Ember's Spark jar
    was compiled against a Spark of another Scala version (reinstall Ember
    where this Spark's pyspark is importable, or with ``SPARK_HOME`` set)."""


class RunFailed(EmberError, RuntimeError):
    """Every attempt of :func:`ember.yarn.run_on_yarn` failed.  The message names
    the failing task of the last attempt and includes its traceback and the
    tail of its container logs.

    Attributes:
        task: the failing task (``"worker:1"``), or None if no task failed
            (the application itself did, e.g. timed out or was killed).
        app_ids: every attempt's application id.
        traceback: the failing task's traceback ("" if it sent none).
        logs: container log tails of the failing task, file name -> text.
        failures: every attempt's message.
    """

    def __init__(self, message: str, task: Optional[str], app_ids: List[str],
                 traceback: str, logs: Dict[str, str], failures: List[str]) -> None:
        super().__init__(message)
        self.task = task
        self.app_ids = app_ids
        self.traceback = traceback
        self.logs = logs
        self.failures = failures


# The last line of a Python traceback that ended in an EmberFeedError, as it
# appears in the text of Spark's PythonException (Java) or its Python wrapper.
_TRACEBACK_LINE = re.compile(r"^(?:[\w.]+\.)?EmberFeedError: (.+)$", re.MULTILINE)


def find_feed_error(text: str) -> Optional[str]:
    """The message of the first EmberFeedError in a failed Spark job's text, or None."""
    m = _TRACEBACK_LINE.search(text)
    return m.group(1).strip() if m else None


_STAGE_FAILURE = re.compile(
    r"Job aborted due to stage failure: Task (?P<task>\d+) in stage (?P<stage>[\d.]+) failed "
    r"(?P<attempts>\d+) times?, most recent failure: Lost task [\d.]+ in stage [\d.]+ "
    r"\(TID \d+\) \((?P<host>\S+) executor (?P<executor>[^)]+)\): (?P<rest>.*)", re.DOTALL)
# a barrier stage's failure (Spark does not retry one task of it)
_BARRIER_FAILURE = re.compile(
    r"Could not recover from a failed barrier ResultStage\. Most recent failure reason: "
    r"Stage failed because barrier task ResultTask\((?P<stage>\d+), (?P<task>\d+)\) "
    r"finished unsuccessfully\.\s*(?:[\w.$]+PythonException: )?(?P<rest>.*)", re.DOTALL)
# a job cancelled (cancelJobGroup, cancelAllJobs, the UI's kill link, the
# SparkContext stopping), with or without Spark 4's error class
_CANCELLED = re.compile(r"(?:\[SPARK_JOB_CANCELLED\] )?Job (?P<job>\d+) cancelled(?P<why>[^\n]*)")
# Spark's advice after a crashed Python worker, and Java's exception class names
_ADVICE = re.compile(r"\s*Consider setting .*$")
_JAVA_CLASS = re.compile(r"^(?:[a-z]\w*\.)+[A-Z]\w*: ")


def _python_traceback(text: str) -> str:
    """The Python traceback at the start of ``text`` (a PythonException's
    message), up to the Java frames after it."""
    lines = []
    for line in text.splitlines():
        if line.startswith("\tat ") or line.startswith("Driver stacktrace"):
            break
        lines.append(line)
    return "\n".join(lines).strip()


def _last_line(traceback: str) -> str:
    """The exception line of a Python traceback (its last unindented line)."""
    return next((ln for ln in reversed(traceback.splitlines()) if ln and not ln[0].isspace()),
                "the task raised")


def spark_job_cause(text: str) -> Optional[str]:
    """The cause of a Spark job's failure, from its exception's text: one line
    naming the task, stage, executor and host and what went wrong, then the
    task's Python traceback if it had one, or the line of a cancelled job;
    None if ``text`` is neither in Spark's usual words."""
    m = _STAGE_FAILURE.search(text)
    b = _BARRIER_FAILURE.search(text) if m is None else None
    if b is not None:
        where = f"barrier task {b.group('task')} of stage {b.group('stage')} failed"
        tb = _python_traceback(b.group("rest").lstrip())
        if not tb.startswith("Traceback (most recent call last):"):
            return f"{where}: {tb.splitlines()[0] if tb else 'no reason given'}"
        return f"{where}: {_last_line(tb)}\n{tb}"
    if m is None:
        c = _CANCELLED.search(text)
        if c is None:
            return None
        why = re.sub(r"\s*SQLSTATE: \w+\s*$", "", c.group("why")).strip()
        return f"job {c.group('job')} was cancelled" + (f" ({why})" if why else "")
    rest = _JAVA_CLASS.sub("", m.group("rest").lstrip())
    where = (f"task {m.group('task')} of stage {m.group('stage')} failed on executor "
             f"{m.group('executor')} (host {m.group('host')}), {m.group('attempts')} "
             "attempt(s)")
    if rest.startswith("Traceback (most recent call last):"):
        tb = _python_traceback(rest)
        return f"{where}: {_last_line(tb)}\n{tb}"
    first = _ADVICE.sub("", rest.splitlines()[0] if rest else "").strip()
    return f"{where}: {first or 'no reason given'}"


def __getattr__(name: str) -> Any:
    # the extension's subclasses: it imports this module while it loads, so
    # they are looked up when asked for, not at import
    if name in _CORE_CLASSES:
        from ember import _ember

        return getattr(_ember, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
