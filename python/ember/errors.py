"""Errors of Ember's Python layer that cross from Spark tasks to the driver.

``EmberFeedError`` is raised where records become feed columns (in a feeding
task) and again, with the same message first, by ``Cluster.train`` on the
driver.  The C core's own errors (``EmberError`` and its subclasses) live in
``ember._ember``; a node's failure is ``ember.spark.EmberNodeError``.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["EmberFeedError", "find_feed_error"]


class EmberFeedError(ValueError):
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


# The last line of a Python traceback that ended in an EmberFeedError, as it
# appears in the text of Spark's PythonException (Java) or its Python wrapper.
_TRACEBACK_LINE = re.compile(r"^(?:[\w.]+\.)?EmberFeedError: (.+)$", re.MULTILINE)


def find_feed_error(text: str) -> Optional[str]:
    """The message of the first EmberFeedError in a failed Spark job's text, or None."""
    m = _TRACEBACK_LINE.search(text)
    return m.group(1).strip() if m else None
