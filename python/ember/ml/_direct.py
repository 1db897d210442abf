"""EmberModel.transform's direct path, driver side (see ``ember.spark.DirectInference``
in ``spark/src``): the executor JVM packs each batch's input columns straight
into a pipe to an Ember inference worker (:mod:`ember.ml._direct_worker`),
instead of Spark's row -> Arrow writer, which handles an ``array<float>`` one
value at a time, and the Arrow UDF operator's row queue and projections.

It needs Ember's Spark jar on the driver and executor classpath
(added to the session on first use) and covers batch DataFrames whose
model inputs are numbers, fixed-length arrays of float/double/int/bigint, or
tensor columns (:mod:`ember.tensors`); :func:`plan` says why when it does not
apply, and the model then runs through Spark's Arrow UDF path.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ember import _jars, tensors

_JAVA_CLASS = "ember.spark.DirectInference"

#: Spark element type name -> (numpy dtype, 'f' float or 'i' integer)
_ELEMENTS = {"float": ("<f4", "f"), "double": ("<f8", "f"), "integer": ("<i4", "i"),
             "long": ("<i8", "i")}


def jar_path() -> str:
    """Ember's Spark jar: package data (``ember/jars``), built with the package."""
    return _jars.SPARK_JAR


def _java_class(spark: Any) -> Any:
    """The JVM class, Ember's jar added to the session when ``spark.jars`` did
    not (:func:`ember._grouping.java_class`); None if the jar is missing."""
    from ember import _grouping

    return _grouping.java_class(spark.sparkContext, _JAVA_CLASS)


def plan(dataset: Any, columns: Sequence[str], inputs: Sequence[Any]) -> Tuple[Optional[List], str]:
    """([(column, kind, numpy dtype, row shape)], '') when the direct path can
    run ``dataset`` through the model inputs ``inputs``; (None, why) if not."""
    from pyspark.sql import types as T

    if dataset.isStreaming:
        return None, "a streaming DataFrame"
    if _java_class(dataset.sparkSession) is None:
        return None, f"{_JAVA_CLASS} is not on the JVM classpath (spark.jars={jar_path()})"
    specs = tensors.tensor_specs(dataset.schema)
    out: List[Tuple[str, str, str, Tuple[int, ...]]] = []
    for c, info in zip(columns, inputs):
        t = dataset.schema[c].dataType
        rest = None if info.shape is None else info.shape[1:]
        if c in specs:
            np_dtype, shape = specs[c]
            out.append((c, f"b:{int(np.prod(shape)) * np_dtype.itemsize}", np_dtype.str, shape))
        elif isinstance(t, T.ArrayType) and t.elementType.typeName() in _ELEMENTS:
            if rest is None or not rest or any(d is None for d in rest):
                return None, f"model input {info.key!r} has no fixed row shape"
            dtype, kind = _ELEMENTS[t.elementType.typeName()]
            width = int(np.prod(rest))
            out.append((c, f"a:{np.dtype(dtype).itemsize}:{width}:{kind}", dtype, (width,)))
        elif t.typeName() in _ELEMENTS:
            dtype, kind = _ELEMENTS[t.typeName()]
            out.append((c, f"s:{np.dtype(dtype).itemsize}:{kind}", dtype, ()))
        else:
            return None, f"column {c!r} is {t.simpleString()}"
    return out, ""


def transform(dataset: Any, spec: Dict[str, Any], columns: List, output_fields: List[Any]) -> Any:
    """``dataset`` with the model's output columns, through the direct path."""
    from pyspark import cloudpickle
    from pyspark.sql import DataFrame
    from pyspark.sql import types as T

    spark = dataset.sparkSession
    sc = spark.sparkContext
    batch_size = int(spec["batch_size"])
    # what the worker needs, and nothing of this DataFrame's other columns: a
    # worker keeps the model loaded for every later transform with the same
    # model and inputs
    spec = {k: v for k, v in spec.items() if k not in ("keep", "batch_size", "struct")}
    spec["direct_columns"] = [(c, dtype, list(shape)) for c, _k, dtype, shape in columns]
    blob = cloudpickle.dumps(spec)
    gateway = sc._gateway
    names = gateway.new_array(gateway.jvm.String, len(columns))
    kinds = gateway.new_array(gateway.jvm.String, len(columns))
    for i, (c, kind, _d, _s) in enumerate(columns):
        names[i], kinds[i] = c, kind
    schema = T.StructType(list(dataset.schema.fields) + list(output_fields))
    # workers are shared by the models of one runtime (a worker loads the
    # model a task needs), never across runtimes: TensorFlow and torch in one
    # process is what Ember's own venv avoids (requirements.txt: triton)
    jdf = _java_class(spark).transform(dataset._jdf, names, kinds, blob,
                                       hashlib.sha256(blob).hexdigest(),
                                       spec.get("format", "savedmodel"),
                                       str(spec.get("checkpoint") or spec["export_dir"]), schema.json(),
                                       sc.pythonExec, batch_size)
    return DataFrame(jdf, spark)
