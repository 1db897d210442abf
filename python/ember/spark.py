"""Run a TensorFlow/PyTorch ``main_fun`` on every node of a Spark job.

The 5-line version::

    from ember.spark import run, InputMode
    cluster = run(sc, main_fun, args, num_executors=2, input_mode=InputMode.SPARK)
    cluster.train(rdd, num_epochs=3)
    predictions = cluster.inference(test_rdd)   # (a second cluster, in inference mode)
    cluster.shutdown()

``run`` starts the C rendezvous server with a fresh secret, launches one node
per barrier task (gang-scheduled: all start or none), waits until every node
has registered (or raises naming the missing ones), and returns a
:class:`Cluster`.  Node failures reach the driver over the control channel:
their tracebacks are re-raised from ``train``, ``inference`` waits and
``shutdown`` as :class:`EmberNodeError`.

This is the public module; the code lives where it runs: the driver's in
:mod:`ember.driver` (``run``, ``Cluster``), the executors' in
:mod:`ember.executor` (the nodes' launch and the feeding tasks), the nodes'
in :mod:`ember.node` and :mod:`ember._trainer`.
"""

from __future__ import annotations

from ember.driver import FEED_ROLES, Cluster, InputMode, run
from ember.errors import EmberError, EmberFeedError, EmberJobError, EmberNodeError

__all__ = ["run", "InputMode", "Cluster", "EmberNodeError", "EmberFeedError", "EmberJobError",
           "EmberError", "FEED_ROLES"]
