"""TensorFlowOnSpark-style programs run by tests/python/test_compat_tfos.py.

Each imports only from ``ember.compat.tfos`` (plus TensorFlow, numpy and
pyspark), as a TFoS 2.2.x program would after changing its imports.
"""
