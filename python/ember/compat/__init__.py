"""Drop-in APIs of other distributed-training libraries, on Ember's engine.

* :mod:`ember.compat.tfos` -- TensorFlowOnSpark 2.2.x (``TFCluster``,
  ``TFNode``, ``InputMode``, ``dfutil``, ``TFParallel``, ``compat``,
  ``pipeline``): change ``from tensorflowonspark import ...`` to
  ``from ember.compat.tfos import ...`` and the job runs on Ember.
"""
