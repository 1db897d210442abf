"""Spark ML pipeline stages: an Estimator that trains on an Ember cluster, a
Model that runs distributed batched inference (TensorFlowOnSpark's
``pipeline.TFEstimator`` / ``pipeline.TFModel``, SPARK-22658).

The 5-line version::

    from ember.ml import EmberEstimator
    est = (EmberEstimator(train_fn, {"learning_rate": 1e-3})
           .setInputMapping({"image": "image", "label": "label"})
           .setClusterSize(2).setEpochs(3).setModelDir(d).setExportDir(d + "/export"))
    model = est.fit(train_df).setOutputMapping({"classes": "prediction"})
    model.transform(test_df)                      # test_df + a "prediction" column

``fit(df)`` selects the InputMapping's columns (renamed to their input
names, in the order of the sorted column names, as TensorFlowOnSpark fed
them), starts ``ember.spark.run(sc, train_fn, args, ClusterSize, ...)``, feeds
the columns with ``cluster.train(df, Epochs)`` (Arrow batches, through
Ember's feed), shuts the cluster down and returns an :class:`EmberModel` over
ExportDir.  ``train_fn(args, ctx)`` gets ``tf_args`` with every Param merged
in under its snake_case name (``batch_size``, ``epochs``, ``steps``,
``model_dir``, ``export_dir``, ``input_mapping``, ...).

``EmberModel.transform(df)`` runs the SavedModel in every Spark Python worker
through ``mapInArrow``: the model is loaded once per worker process and
reused by all its tasks; columns become numpy arrays without a Python object
per value; the output columns get Spark types from the model's outputs.

ExportDir and ModelDir may be ``hdfs://`` or ``webhdfs://`` URLs (the
NameNode from ``HADOOP_CONF_DIR``; executors without it take the driver's):
the driver and each executor host copy the model once per version into a
local cache (:mod:`ember.ml._model_files`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Union, cast

from pyspark.ml import Estimator, Model
from pyspark.ml.param import Params
from pyspark.ml.util import (DefaultParamsReadable, DefaultParamsReader, DefaultParamsWriter,
                             MLReadable, MLWritable)

from ember import _gpu, _log, _spark_compat, connect, tensors
from ember.errors import EmberError
from ember.ml import _direct, _model_files, _runtime, _torch
from ember.ml._params import (HasArrowPath, HasBatchSize, HasClusterSize, HasDriverPSNodes,
                              HasEpochs, HasExportDir, HasGpusPerNode, HasGraceSecs,
                              HasInputMapping, HasInputMode, HasMasterNode, HasMaxRestarts,
                              HasModelDir, HasNumPS, HasOutputMapping, HasProtocol, HasReaders,
                              HasReservationTimeout, HasSignatureDefKey, HasSteps, HasTagSet,
                              HasTensorboard, HasTFRecordDir)
from ember.ml._runtime import ModelInputError

__all__ = ["EmberEstimator", "EmberModel", "EmberTorchModel", "TFEstimator", "TFModel",
           "TorchModel", "ModelInputError", "save_torchscript"]


logger = logging.getLogger("ember.ml")


# --------------------------------------------------------------------------- params

class _EmberParams(Params):
    """What every Ember stage does with its Params: hand them to train_fn."""

    tf_args: Union[argparse.Namespace, Dict[str, Any], None]  # set by each __init__

    def _merged_args(self, tf_args: Any) -> Any:
        """tf_args with every Param merged in (the type of tf_args: dict stays a dict,
        anything else becomes an argparse.Namespace)."""
        values = {p.name: self.getOrDefault(p) for p in self.params}
        if isinstance(tf_args, dict):
            return dict(tf_args, **values)
        merged = argparse.Namespace(**(vars(tf_args) if tf_args is not None else {}))
        for k, v in values.items():
            setattr(merged, k, v)
        return merged


# --------------------------------------------------------------------------- persistence

def _fn_ref(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a module-level function, checked to resolve back to it."""
    ref = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', None)}"
    try:
        if _resolve(ref) is fn:
            return ref
    except Exception:  # noqa: BLE001 - reported below with what to do
        pass
    raise ValueError(f"cannot save train_fn {ref}: only a function importable by module and "
                     "name can be saved (not a lambda, a closure or a function of __main__)")


def _resolve(ref: str) -> Any:
    module, _, qual = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _args_json(tf_args: Any) -> Any:
    if tf_args is None:
        return None
    kind = "dict" if isinstance(tf_args, dict) else "namespace"
    values = tf_args if isinstance(tf_args, dict) else vars(tf_args)
    try:
        json.dumps(values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot save tf_args: its values must be JSON-serializable ({exc})") from exc
    return {"kind": kind, "values": values}


def _args_from_json(saved: Any) -> Any:
    if saved is None:
        return None
    if saved["kind"] == "dict":
        return dict(saved["values"])
    return argparse.Namespace(**saved["values"])


class _Writer(DefaultParamsWriter):
    """Params as DefaultParamsWriter writes them, plus tf_args (JSON) and the
    Estimator's train_fn as ``module:qualname`` in the metadata's extra fields."""

    instance: "_EmberParams"  # what _Persist.write passes

    def saveImpl(self, path: str) -> None:
        inst = self.instance
        extra = {"tf_args": _args_json(inst.tf_args)}
        if isinstance(inst, EmberEstimator):
            extra["train_fn"] = None if inst.train_fn is None else _fn_ref(inst.train_fn)
        DefaultParamsWriter.saveMetadata(inst, path, _spark_compat.ml_context(self.sparkSession),
                                         extraMetadata=extra)


class _Reader(DefaultParamsReader):
    def load(self, path: str) -> Any:
        metadata = DefaultParamsReader.loadMetadata(path,
                                                    _spark_compat.ml_context(self.sparkSession))
        inst = super().load(path)
        inst.tf_args = _args_from_json(metadata.get("tf_args"))
        if isinstance(inst, EmberEstimator) and metadata.get("train_fn"):
            inst.train_fn = _resolve(metadata["train_fn"])
        return inst


class _Persist(MLWritable, MLReadable):
    # mixed only into _EmberParams classes (EmberEstimator, _ArrowInference),
    # which DefaultParamsWriter and DefaultParamsReader take
    def write(self) -> _Writer:
        return _Writer(cast(_EmberParams, self))

    @classmethod
    def read(cls) -> _Reader:
        return _Reader(cast("type[DefaultParamsReadable[Any]]", cls))


# --------------------------------------------------------------------------- estimator

class EmberEstimator(Estimator, _EmberParams, _Persist, HasInputMapping, HasOutputMapping,
                     HasModelDir, HasExportDir, HasBatchSize, HasClusterSize, HasNumPS,
                     HasDriverPSNodes, HasReaders, HasTensorboard, HasSteps, HasEpochs,
                     HasProtocol, HasInputMode, HasTFRecordDir, HasMasterNode, HasGraceSecs,
                     HasMaxRestarts, HasReservationTimeout, HasSignatureDefKey, HasTagSet,
                     HasGpusPerNode):
    """Trains ``train_fn(args, ctx)`` on an Ember cluster fed with a DataFrame.

    :param train_fn: the node function (as for :func:`ember.spark.run`).  To
        save the Estimator it must be importable by module and name (it is
        stored as ``module:qualname`` and imported back on load).
    :param tf_args: an ``argparse.Namespace`` or a dict; ``train_fn`` gets a
        copy with every Param merged in.
    """


    def __init__(self, train_fn: Optional[Callable[[Any, Any], Any]] = None,
                 tf_args: Union[argparse.Namespace, Dict[str, Any], None] = None) -> None:
        super().__init__()
        self.train_fn = train_fn
        self.tf_args = tf_args
        self._setDefault(input_mapping={}, output_mapping={}, model_dir=None, export_dir=None,
                         batch_size=100, cluster_size=1, num_ps=0, driver_ps_nodes=False,
                         readers=1, tensorboard=False, steps=1000, epochs=1, protocol="grpc",
                         input_mode=1, tfrecord_dir=None, master_node="chief", grace_secs=0,
                         max_restarts=0, reservation_timeout=600.0,
                         signature_def_key="serving_default", tag_set="serve", gpus_per_node=0)

    def _fit(self, dataset: Any) -> "_ArrowInference":
        from ember.spark import InputMode, run

        _log.default_handler()  # a job's entry point, as ember.spark.run
        if self.train_fn is None:
            raise ValueError("EmberEstimator has no train_fn")
        mapping = self.getInputMapping()
        if not mapping:
            raise ValueError("EmberEstimator: set InputMapping (DataFrame column -> input name)")
        missing = [c for c in mapping if c not in dataset.columns]
        if missing:
            raise ModelInputError(f"InputMapping names column(s) {missing} that the DataFrame "
                                  f"does not have (columns: {dataset.columns})")
        from pyspark.sql import functions as F

        cols = sorted(mapping)  # TensorFlowOnSpark's feeding order
        df = dataset.select(*[F.col(f"`{c}`").alias(mapping[c]) for c in cols])
        args = self._merged_args(self.tf_args)
        mode = InputMode(self.getInputMode())
        if mode == InputMode.TENSORFLOW:
            from ember import tfrecord

            out = self.getTFRecordDir()
            if not out:
                raise ValueError("InputMode.TENSORFLOW: set TFRecordDir (where fit writes the "
                                 "DataFrame for train_fn to read)")
            n = tfrecord.save(df, out, mode="overwrite")
            logger.info(f"wrote {n} records as TFRecords to {out}")
        session = dataset.sparkSession
        # a Spark Connect client's session runs the nodes itself (ember.connect)
        sc = session if connect.is_connect(session) else session.sparkContext
        cluster = run(sc, self.train_fn, args, num_executors=self.getClusterSize(),
                      num_ps=self.getNumPS(), tensorboard=self.getTensorboard(),
                      input_mode=mode, driver_ps_nodes=self.getDriverPSNodes(),
                      master_node=self.getMasterNode(), max_restarts=self.getMaxRestarts(),
                      reservation_timeout=self.getReservationTimeout(),
                      gpus_per_node=self.getGpusPerNode(), env=self._node_env(sc))
        # the job's MLflow run (ember.mlflow) ends here, after the model is logged
        cluster._mlflow_end_on_shutdown = False
        if cluster._mlflow is not None:
            cluster._mlflow.set_tags({"ember.estimator": self.uid,
                                      "ember.input_columns": ",".join(cols)})
        try:
            if mode == InputMode.SPARK:
                cluster.train(df, num_epochs=self.getEpochs())
        except BaseException as exc:
            try:
                cluster.shutdown(timeout=60)
            except Exception as exc2:  # noqa: BLE001 - the first error is the one to raise
                logger.warning(f"shutdown after a failed fit: {exc2} (the fit's own error "
                               "follows)")
            cluster._track_end("FAILED", exc)
            raise
        try:
            cluster.shutdown(grace_secs=self.getGraceSecs())
            model = self._make_model(args)
        except BaseException as exc:
            cluster._track_end("FAILED", exc)
            raise
        export = self.getExportDir()
        local = _artifact_dir(export) if export and cluster._mlflow is not None else None
        if local:
            cluster.log_artifacts(local, "model")
        cluster._track_end("FINISHED")
        return model

    def _node_env(self, sc: Any) -> Dict[str, str]:
        """Extra environment variables for the nodes (``run(env=)``): none here;
        ``ember.compat.tfos.pipeline.TFEstimator`` gives its nodes what
        ``TFCluster.run`` gives them."""
        return {}

    def _make_model(self, args: Any) -> "_ArrowInference":
        """The Model of what train_fn exported: an EmberTorchModel when ExportDir
        holds a TorchScript archive, else an EmberModel (SavedModel, or the
        TF1 checkpoint in ModelDir)."""
        export = self.getExportDir()
        if export and _torch.torchscript_file(export):
            return self._make_torch_model(args, export)
        model = EmberModel(args)
        for name in ("model_dir", "export_dir", "signature_def_key", "tag_set", "output_mapping"):
            if self.isDefined(getattr(self, name)):
                model._set(**{name: self.getOrDefault(getattr(self, name))})
        # The model takes the mapped columns its export takes as inputs (the
        # label a train_fn was fed is not one of them).
        mapping = dict(self.getInputMapping())
        export = self.getExportDir()
        if export and self.getSignatureDefKey():
            try:
                mg = _runtime._meta_graph(export, _tags(self.getTagSet()))
                sig = mg.signature_def.get(self.getSignatureDefKey())
            except (EmberError, OSError) as exc:  # ModelInputError too
                logger.info(f"the model keeps the whole InputMapping: signature "
                            f"{self.getSignatureDefKey()!r} of {export} could not be read "
                            f"({exc})")
                sig = None
            if sig is not None:
                dropped = {c: t for c, t in mapping.items() if t not in sig.inputs}
                mapping = {c: t for c, t in mapping.items() if t in sig.inputs}
                if dropped:
                    logger.info(_not_fed(dropped, f"signature {self.getSignatureDefKey()!r}",
                                         "input"))
        model._set(input_mapping=mapping)
        return model

    def _make_torch_model(self, args: Any, export: str) -> "EmberTorchModel":
        model = EmberTorchModel(args).setExportDir(export)
        if self.isDefined(self.output_mapping):
            model.setOutputMapping(self.getOutputMapping())
        # the mapped columns that name forward() arguments (not the label)
        path = _torch.require_file(export)  # _make_model found it there
        module, _ = _torch.load(path)
        names = {n for n, _, _ in _torch.forward_arguments(module)}
        positions = {str(i) for i in range(len(names))}
        mapping = {c: t for c, t in self.getInputMapping().items() if t in names or t in positions}
        dropped = {c: t for c, t in self.getInputMapping().items() if c not in mapping}
        if dropped:
            logger.info(_not_fed(dropped, f"forward() of {path}", "argument"))
        return model.setInputMapping(mapping)


def _artifact_dir(export: str) -> Optional[str]:
    """What MLflow uploads as the model: ExportDir, or, on HDFS, this host's
    copy of it (MLflow reads local files only); None if there is none."""
    if not _model_files.is_remote(export):
        return export
    try:
        archive = _torch.torchscript_file(export)
        if archive:
            return os.path.dirname(_model_files.model_file(archive)[0])
        return _model_files.saved_model(export)[0]
    except (EmberError, OSError) as exc:
        logger.warning(f"not logging {export} as an artifact: {exc}")
        return None


def _not_fed(dropped: Dict[str, str], of: str, what: str) -> str:
    """The line that says which of the fit's InputMapping columns the model
    does not take (``dropped``: column -> the name it was fed as): e.g.
    ``column label is not an input of signature 'serving_default';
    transform() will not feed it``."""
    names = ", ".join(c if dropped[c] == c else f"{c} (as {dropped[c]!r})"
                      for c in sorted(dropped))
    if len(dropped) == 1:
        return f"column {names} is not an {what} of {of}; transform() will not feed it"
    return f"columns {names} are not {what}s of {of}; transform() will not feed them"


# --------------------------------------------------------------------------- model

def _tags(tag_set: Optional[str]) -> Optional[List[str]]:
    return [t.strip() for t in tag_set.split(",") if t.strip()] if tag_set else None


def _spark_type(info: "_runtime.TensorInfo") -> Any:
    from pyspark.sql.pandas.types import from_arrow_type

    return from_arrow_type(_runtime.arrow_type(info))


class _ArrowInference(Model, _EmberParams, _Persist, HasInputMapping, HasOutputMapping,
                      HasExportDir, HasBatchSize, HasArrowPath):
    """What EmberModel and EmberTorchModel share: ``transform`` through Spark's
    Arrow path (an Arrow UDF or ``mapInArrow``) over the spec a subclass's
    ``_inference_spec`` checks on the driver, and the column checks."""

    def _inference_spec(self, dataset: Any) -> Dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def _hadoop_conf(*paths: Optional[str]) -> Optional[str]:
        """The driver's HADOOP_CONF_DIR for the executors when a model path is on
        HDFS (they use it where they have none of their own), else None."""
        if any(_model_files.is_remote(p) for p in paths):
            return os.environ.get("HADOOP_CONF_DIR")
        return None

    def _check_mappings(self, dataset: Any) -> tuple:
        """(sorted input columns, sorted output keys), after the checks every
        model makes: both mappings set, the input columns present, no output
        column that exists already."""
        name = type(self).__name__
        in_map, out_map = self.getInputMapping(), self.getOutputMapping()
        if not in_map:
            raise ValueError(f"{name}: set InputMapping (DataFrame column -> model input)")
        if not out_map:
            raise ValueError(f"{name}: set OutputMapping (model output -> DataFrame column)")
        cols = sorted(in_map)
        missing = [c for c in cols if c not in dataset.columns]
        if missing:
            raise ModelInputError(f"InputMapping column(s) {missing} not in the DataFrame "
                                  f"(columns: {dataset.columns})")
        clash = [c for c in out_map.values() if c in dataset.columns]
        if clash:
            raise ModelInputError(f"OutputMapping column(s) {clash} already exist in the DataFrame")
        return cols, sorted(out_map)

    @staticmethod
    def _check_column(dataset: Any, field: Any, info: "_runtime.TensorInfo") -> None:
        import numpy as np
        from pyspark.sql import types as T

        want_rank = None if info.shape is None else len(info.shape) - 1
        tensor = tensors.field_spec(field)
        if tensor is not None:  # ember.tensors: dtype and row shape are in the schema
            dtype, shape = tensor
            what = f"model input {info.key!r} ({info.describe()})"
            if info.dtype.kind in "iub" and dtype.kind == "f":
                raise ModelInputError(f"tensor column {field.name!r} holds {dtype.name}; {what} "
                                      "takes integers")
            rest = None if info.shape is None else info.shape[1:]
            if rest is not None and all(d is not None for d in rest) and \
                    int(np.prod(rest, dtype=np.int64)) != int(np.prod(shape, dtype=np.int64)):
                raise ModelInputError(f"tensor column {field.name!r} holds {dtype.name}"
                                      f"{list(shape)} per row; {what} takes "
                                      f"{int(np.prod(rest, dtype=np.int64))} values per row")
            return
        t, depth = field.dataType, 0
        while isinstance(t, T.ArrayType):
            t, depth = t.elementType, depth + 1
        if type(t).__name__ == "VectorUDT":
            t, depth = T.DoubleType(), depth + 1
        numeric = isinstance(t, (T.NumericType, T.BooleanType)) and not isinstance(t, T.DecimalType)
        what = f"model input {info.key!r} ({info.describe()})"
        if not numeric:
            raise ModelInputError(f"column {field.name!r} has type {field.dataType.simpleString()}; "
                                  f"{what} needs numbers")
        if info.dtype.kind in "iub" and isinstance(t, (T.FloatType, T.DoubleType)):
            raise ModelInputError(f"column {field.name!r} has type {field.dataType.simpleString()}; "
                                  f"{what} takes integers (cast the column explicitly)")
        if want_rank is not None and want_rank == 0 and depth > 0:
            raise ModelInputError(f"column {field.name!r} holds arrays "
                                  f"({field.dataType.simpleString()}); {what} takes one number per row")
        if want_rank is not None and want_rank > 0 and depth == 0:
            raise ModelInputError(f"column {field.name!r} holds one number per row "
                                  f"({field.dataType.simpleString()}); {what} takes arrays")
        if want_rank and depth and not dataset.isStreaming and info.shape is not None:
            rest = info.shape[1:]
            if all(d is not None for d in rest):
                from pyspark.sql import functions as F

                width = 1
                for d in rest:
                    width *= int(d)
                # one row's length (a small job, before any inference task);
                # nested arrays: the flattened length
                col = F.col(f"`{field.name}`")
                if type(field.dataType).__name__ == "VectorUDT":
                    from pyspark.ml.functions import vector_to_array
                    col = vector_to_array(col)
                for _ in range(depth - 1):
                    col = F.flatten(col)
                row = dataset.select(F.size(col).alias("n")).limit(1).collect()
                if row and row[0]["n"] != width:
                    raise ModelInputError(
                        f"column {field.name!r} has arrays of {row[0]['n']} values; {what} "
                        f"takes {width} per row")

    def _transform(self, dataset: Any) -> Any:
        import functools

        from pyspark.sql import functions as F
        from pyspark.sql import types as T

        chosen = self.getArrowPath()
        path = chosen or ("udf" if _spark_compat.has(_spark_compat.ARROW_UDF) else "mapInArrow")
        if path not in ("direct", "udf", "mapInArrow"):
            raise ValueError(f"ArrowPath must be 'direct', 'udf' or 'mapInArrow', not {path!r}")
        if path == "udf":
            _spark_compat.require("ArrowPath 'udf' (pyspark.sql.functions.arrow_udf)",
                                  _spark_compat.ARROW_UDF)
        spec = self._inference_spec(dataset)
        out_cols, types = spec["output_columns"], spec.pop("output_types")
        spec["tensors"] = {c: (t[0].str, list(t[1])) for c, t in
                           tensors.tensor_specs(dataset.schema).items() if c in spec["columns"]}
        remote = connect.is_connect(dataset.sparkSession)
        if chosen == "direct" and remote:
            raise ValueError("ArrowPath 'direct' runs in the executors' JVM through py4j, which a "
                             "Spark Connect client does not have: use 'udf' or 'mapInArrow'")
        if chosen in (None, "direct") and not remote:
            columns, why = _direct.plan(dataset, spec["columns"], _runtime.predictor(spec).inputs)
            if columns is not None:
                return _direct.transform(dataset, spec, columns, [
                    T.StructField(c, t, True) for c, t in zip(out_cols, types)])
            if chosen == "direct":
                raise ValueError(f"ArrowPath 'direct' cannot run this DataFrame: {why}")
        # GPU tasks: a reused Python worker must not keep another task's GPU
        _gpu.check_python_worker_gpus(connect.session_conf(dataset.sparkSession), path)
        if path == "mapInArrow":
            fields = list(dataset.schema.fields) + [
                T.StructField(c, t, True) for c, t in zip(out_cols, types)]
            return dataset.mapInArrow(functools.partial(_runtime.infer_partition, spec),
                                      T.StructType(fields))
        # An Arrow UDF (ArrowEvalPython): only the input columns go to Python;
        # Spark keeps the others and zips the results back (no copy of the
        # input arrays back into the JVM, which mapInArrow has to make).
        spec["struct"] = len(out_cols) > 1
        ret = T.StructType([T.StructField(c, t, True) for c, t in zip(out_cols, types)]) \
            if spec["struct"] else types[0]
        with warnings.catch_warnings():  # "prefer type hints": a partial has none
            warnings.simplefilter("ignore", UserWarning)
            udf = F.arrow_udf(functools.partial(_runtime.infer_arrays, spec), ret,
                              F.ArrowUDFType.SCALAR)
        call = udf(*[F.col(f"`{c}`") for c in spec["columns"]])
        if not spec["struct"]:
            return dataset.withColumn(out_cols[0], call)
        tmp = f"__ember_out_{self.uid}"
        out = dataset.withColumn(tmp, call)
        return out.select(*[F.col(f"`{c}`") for c in dataset.columns],
                          *[F.col(f"`{tmp}`")[c].alias(c) for c in out_cols])


class EmberModel(_ArrowInference, HasModelDir, HasSignatureDefKey, HasTagSet):
    """Distributed batched inference with a SavedModel.

    InputMapping maps DataFrame columns to model inputs and OutputMapping model
    outputs to new columns.  With a SignatureDefKey (default
    ``serving_default``) the names are the signature's input/output aliases;
    with ``setSignatureDefKey(None)`` they are graph tensor names (``"x"``
    meaning ``"x:0"``), as for a TF1 graph.  Without ExportDir, the latest TF1
    checkpoint in ModelDir runs with its ``.meta`` graph (mappings by tensor
    name; TensorFlowOnSpark's checkpoint style).  ``transform(df)`` returns ``df``
    with the output columns appended; an output of one value per row becomes a
    number column (float, double, long, int...), a larger one ``array<...>``
    (flattened row-major).  BatchSize is the rows per model call (Arrow
    batches are at most ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows).
    ArrowPath picks the path: Ember's direct path (the default where the
    DataFrame allows it: not streaming, inputs of numbers, fixed-length arrays
    or tensor columns), an Arrow UDF (Spark >= 4.1) or ``mapInArrow``.
    """


    def __init__(self, tf_args: Union[argparse.Namespace, Dict[str, Any], None] = None) -> None:
        super().__init__()
        self.tf_args = tf_args
        self._setDefault(input_mapping={}, output_mapping={}, model_dir=None, export_dir=None,
                         signature_def_key="serving_default", tag_set="serve", batch_size=10000,
                         arrow_path=None)

    def _inference_spec(self, dataset: Any) -> Dict[str, Any]:
        """Checks the DataFrame against the model on the driver; the worker spec."""
        export, checkpoint = self.getExportDir(), self.getModelDir()
        if export or not checkpoint:
            checkpoint = None
        else:
            # TensorFlowOnSpark's checkpoint style: the latest TF1 checkpoint in
            # ModelDir with its MetaGraph; mappings name graph tensors
            export, stamp = _runtime.checkpoint_export(checkpoint)
        if not export:
            raise ValueError("EmberModel: set ExportDir (a SavedModel) or ModelDir (a TF1 "
                             "checkpoint with its .meta graph)")
        cols, outs = self._check_mappings(dataset)
        in_map, out_map = self.getInputMapping(), self.getOutputMapping()
        sig, tags = self.getSignatureDefKey(), _tags(self.getTagSet())
        if checkpoint:
            sig, tags = None, ["serve"]
        else:
            stamp = _runtime.saved_model_stamp(export)
        feeds, fetches = _runtime.resolve(export, sig, tags, [in_map[c] for c in cols], outs)
        spec = dict(export_dir=export, checkpoint=checkpoint, signature=sig, tags=tags, feeds=feeds, fetches=fetches,
                    input_keys=[in_map[c] for c in cols], output_keys=outs, stamp=stamp,
                    columns=cols, output_columns=[out_map[o] for o in outs],
                    keep=list(dataset.columns), batch_size=self.getBatchSize(),
                    hadoop_conf_dir=self._hadoop_conf(export, checkpoint))
        p = _runtime.predictor(spec)  # loads the model on the driver once (cached)
        schema = dataset.schema
        for c, info in zip(cols, p.inputs):
            self._check_column(dataset, schema[c], info)
        spec["output_types"] = [_spark_type(info) for info in p.outputs]
        return spec


class EmberTorchModel(_ArrowInference):
    """Distributed batched inference with a TorchScript module (``torch.jit``).

    ExportDir is a TorchScript archive (what ``torch.jit.save`` writes) or a
    directory holding one as ``model.pt`` (what :func:`save_torchscript` and
    a train_fn of :class:`EmberEstimator` write).  InputMapping maps DataFrame
    columns to ``forward()`` arguments, by name or by position (``"0"``,
    ``"1"``...); every argument without a default must be mapped.
    OutputMapping maps ``forward()``'s outputs to new columns: the keys of a
    returned dict, the positions of a returned tuple, or ``"0"`` for a single
    tensor.  Each output needs the row axis first and gets its column type
    as in :class:`EmberModel` (one value per row: ``float``, ``double``,
    ``bigint``...; more: ``array<...>``, flattened row-major).

    Input dtypes and shapes: a module saved by :func:`save_torchscript` with
    example inputs declares them, and columns are checked against them and
    cast/reshaped to them.  Otherwise columns of floats or doubles become
    tensors of the module's floating dtype (its first floating parameter;
    float32 for most models), integer columns int64, booleans bool, arrays
    keep Spark's flat row shape; and one row of the DataFrame goes through
    ``forward()`` on the driver before any task runs (a dry run), so a
    mismatch fails there, naming the column and what forward() said.

    ``transform(df)`` runs the module in every Python worker as EmberModel
    runs a SavedModel (an Arrow UDF or ``mapInArrow``, loaded once per worker
    process, BatchSize rows per ``forward()`` call under
    ``torch.inference_mode()``; torch uses ``OMP_NUM_THREADS`` threads,
    which Spark sets to ``spark.task.cpus``).
    """


    def __init__(self, tf_args: Union[argparse.Namespace, Dict[str, Any], None] = None) -> None:
        super().__init__()
        self.tf_args = tf_args
        self._setDefault(input_mapping={}, output_mapping={}, export_dir=None, batch_size=10000,
                         arrow_path=None)

    @staticmethod
    def _column_info(field: Any, key: str, arg: str, floating: Any) -> "_runtime.TensorInfo":
        """The tensor an undeclared input gets from column ``field``."""
        import numpy as np
        from pyspark.sql import types as T

        tensor = tensors.field_spec(field)
        if tensor is not None:
            dtype = floating if floating is not None and tensor[0].kind == "f" else tensor[0]
            return _runtime.TensorInfo(key, arg, dtype, (None, *tensor[1]))
        t, depth = field.dataType, 0
        while isinstance(t, T.ArrayType):
            t, depth = t.elementType, depth + 1
        if type(t).__name__ == "VectorUDT":
            t, depth = T.DoubleType(), depth + 1
        if isinstance(t, (T.FloatType, T.DoubleType)):
            dtype = floating if floating is not None else \
                np.dtype(np.float32 if isinstance(t, T.FloatType) else np.float64)
        elif isinstance(t, T.BooleanType):
            dtype = np.dtype(np.bool_)
        elif isinstance(t, T.IntegralType):
            dtype = np.dtype(np.int64)
        else:  # not a number: _check_column names the column
            dtype = floating if floating is not None else np.dtype(np.float32)
        return _runtime.TensorInfo(key, arg, dtype, (None,) * (depth + 1))

    def _inference_spec(self, dataset: Any) -> Dict[str, Any]:
        """Checks the DataFrame against the module on the driver; the worker spec."""
        import numpy as np
        from pyspark.sql import functions as F

        export = self.getExportDir()
        if not export:
            raise ValueError("EmberTorchModel: set ExportDir (a TorchScript archive, or a "
                             f"directory holding one as {_torch.TORCHSCRIPT_FILE})")
        cols, outs = self._check_mappings(dataset)
        in_map, out_map = self.getInputMapping(), self.getOutputMapping()
        path = _torch.require_file(export)
        module, meta = _torch.load(path)
        keys = [in_map[c] for c in cols]
        args = _torch.bind_inputs(module, path, keys)
        schema = dataset.schema
        inputs = _torch.declared_inputs(meta, args, keys)
        if inputs is not None:
            for c, info in zip(cols, inputs):
                self._check_column(dataset, schema[c], info)
            xs = []
            for info in inputs:
                assert info.shape is not None  # declared_inputs records every shape
                xs.append(np.zeros((1, *info.shape[1:]), info.dtype))
            where = "zeros of its declared input shapes"
        else:
            floating = _torch.floating_dtype(module)
            inputs = [self._column_info(schema[c], k, a, floating)
                      for c, k, a in zip(cols, keys, args)]
            for c, info in zip(cols, inputs):
                self._check_column(dataset, schema[c], info)
            if dataset.isStreaming:
                raise ModelInputError(
                    f"{path} declares no input shapes, and a streaming DataFrame has no row "
                    "to type the outputs with: save the module with ember.ml.save_torchscript"
                    "(module, export_dir, example_inputs=...)")
            first = _spark_compat.to_arrow(
                dataset.select(*[F.col(f"`{c}`") for c in cols]).limit(1))
            if first.num_rows == 0:
                raise ModelInputError(
                    f"the DataFrame is empty, and {path} declares no input shapes to type the "
                    "outputs with: save the module with ember.ml.save_torchscript(module, "
                    "export_dir, example_inputs=...)")
            where = "the DataFrame's first row"
            xs = [_runtime.column_to_numpy(first.column(c), c, info, where,
                                           tensors.field_spec(schema[c]))
                  for c, info in zip(cols, inputs)]
        outputs = _torch.dry_run(module, path, args, inputs, xs, outs, cols, where)
        return dict(format="torchscript", export_dir=path, checkpoint=None,
                    stamp=_torch.stamp(path), feeds=args, fetches=outs, input_keys=keys,
                    output_keys=outs, torch_inputs=[_torch.info_dict(i) for i in inputs],
                    torch_outputs=[_torch.info_dict(o) for o in outputs], columns=cols,
                    output_columns=[out_map[o] for o in outs], keep=list(dataset.columns),
                    batch_size=self.getBatchSize(), hadoop_conf_dir=self._hadoop_conf(path),
                    output_types=[_spark_type(info) for info in outputs])


def save_torchscript(module: Any, export_dir: str, example_inputs: Any = None,
                     method: str = "script") -> str:
    """Saves a ``torch.nn.Module`` as TorchScript (``export_dir/model.pt``) for
    :class:`EmberTorchModel`; with ``example_inputs`` (a dict of forward()
    argument -> tensor, or a tuple in argument order, row axis first) the
    inputs' dtypes and row shapes are recorded.  See
    :func:`ember.ml._torch.save_torchscript`."""
    return _torch.save_torchscript(module, export_dir, example_inputs, method)


#: TensorFlowOnSpark's names.
TFEstimator = EmberEstimator
TFModel = EmberModel
TorchModel = EmberTorchModel
