"""The Params of Ember's pipeline stages, declared as pyspark.ml declares its
own (``pyspark.ml.param.shared``): one ``HasX`` mixin per Param, holding the
``Param`` and its ``setX``/``getX``.

The names are TensorFlowOnSpark's (``input_mapping``, ``batch_size``...): a
``train_fn`` written for ``TFEstimator`` finds them as the same attributes of
its ``args``, and saved stages keep them in their metadata.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, TypeVar

from pyspark.ml.param import Param, Params, TypeConverters

P = TypeVar("P", bound=Params)


def _to_mapping(value: Any) -> Dict[str, str]:
    """A dict of str -> str, or a TypeError naming the first wrong entry."""
    if not isinstance(value, dict):
        raise TypeError(f"a mapping must be a dict of str -> str, got {type(value).__name__}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"a mapping must be a dict of str -> str, got {k!r}: {v!r}")
        out[k] = v
    return out


def _to_str_or_none(value: Any) -> Optional[str]:
    return None if value is None else TypeConverters.toString(value)


class HasInputMapping(Params):
    input_mapping: "Param[Dict[str, str]]" = Param(
        Params._dummy(), "input_mapping",
        'DataFrame column -> model input name',
        typeConverter=_to_mapping)

    def setInputMapping(self: P, value: Dict[str, str]) -> P:
        """Sets :py:attr:`input_mapping`: DataFrame column -> model input name."""
        return self._set(input_mapping=value)

    def getInputMapping(self) -> Dict[str, str]:
        """:py:attr:`input_mapping`, or its default."""
        return self.getOrDefault(self.input_mapping)


class HasOutputMapping(Params):
    output_mapping: "Param[Dict[str, str]]" = Param(
        Params._dummy(), "output_mapping",
        'model output name -> DataFrame column',
        typeConverter=_to_mapping)

    def setOutputMapping(self: P, value: Dict[str, str]) -> P:
        """Sets :py:attr:`output_mapping`: model output name -> DataFrame column."""
        return self._set(output_mapping=value)

    def getOutputMapping(self) -> Dict[str, str]:
        """:py:attr:`output_mapping`, or its default."""
        return self.getOrDefault(self.output_mapping)


class HasModelDir(Params):
    model_dir: "Param[Optional[str]]" = Param(
        Params._dummy(), "model_dir",
        'directory of the training checkpoints',
        typeConverter=_to_str_or_none)

    def setModelDir(self: P, value: Optional[str]) -> P:
        """Sets :py:attr:`model_dir`: directory of the training checkpoints."""
        return self._set(model_dir=value)

    def getModelDir(self) -> Optional[str]:
        """:py:attr:`model_dir`, or its default."""
        return self.getOrDefault(self.model_dir)


class HasExportDir(Params):
    export_dir: "Param[Optional[str]]" = Param(
        Params._dummy(), "export_dir",
        'directory of the exported SavedModel',
        typeConverter=_to_str_or_none)

    def setExportDir(self: P, value: Optional[str]) -> P:
        """Sets :py:attr:`export_dir`: directory of the exported SavedModel."""
        return self._set(export_dir=value)

    def getExportDir(self) -> Optional[str]:
        """:py:attr:`export_dir`, or its default."""
        return self.getOrDefault(self.export_dir)


class HasBatchSize(Params):
    batch_size: "Param[int]" = Param(
        Params._dummy(), "batch_size",
        'records per batch',
        typeConverter=TypeConverters.toInt)

    def setBatchSize(self: P, value: int) -> P:
        """Sets :py:attr:`batch_size`: records per batch."""
        return self._set(batch_size=value)

    def getBatchSize(self) -> int:
        """:py:attr:`batch_size`, or its default."""
        return self.getOrDefault(self.batch_size)


class HasClusterSize(Params):
    cluster_size: "Param[int]" = Param(
        Params._dummy(), "cluster_size",
        'number of nodes',
        typeConverter=TypeConverters.toInt)

    def setClusterSize(self: P, value: int) -> P:
        """Sets :py:attr:`cluster_size`: number of nodes."""
        return self._set(cluster_size=value)

    def getClusterSize(self) -> int:
        """:py:attr:`cluster_size`, or its default."""
        return self.getOrDefault(self.cluster_size)


class HasNumPS(Params):
    num_ps: "Param[int]" = Param(
        Params._dummy(), "num_ps",
        'number of parameter-server nodes',
        typeConverter=TypeConverters.toInt)

    def setNumPS(self: P, value: int) -> P:
        """Sets :py:attr:`num_ps`: number of parameter-server nodes."""
        return self._set(num_ps=value)

    def getNumPS(self) -> int:
        """:py:attr:`num_ps`, or its default."""
        return self.getOrDefault(self.num_ps)


class HasDriverPSNodes(Params):
    driver_ps_nodes: "Param[bool]" = Param(
        Params._dummy(), "driver_ps_nodes",
        'run the ps nodes on the driver host',
        typeConverter=TypeConverters.toBoolean)

    def setDriverPSNodes(self: P, value: bool) -> P:
        """Sets :py:attr:`driver_ps_nodes`: run the ps nodes on the driver host."""
        return self._set(driver_ps_nodes=value)

    def getDriverPSNodes(self) -> bool:
        """:py:attr:`driver_ps_nodes`, or its default."""
        return self.getOrDefault(self.driver_ps_nodes)


class HasReaders(Params):
    readers: "Param[int]" = Param(
        Params._dummy(), "readers",
        'reader threads (passed to train_fn)',
        typeConverter=TypeConverters.toInt)

    def setReaders(self: P, value: int) -> P:
        """Sets :py:attr:`readers`: reader threads."""
        return self._set(readers=value)

    def getReaders(self) -> int:
        """:py:attr:`readers`, or its default."""
        return self.getOrDefault(self.readers)


class HasTensorboard(Params):
    tensorboard: "Param[bool]" = Param(
        Params._dummy(), "tensorboard",
        'start TensorBoard on the chief',
        typeConverter=TypeConverters.toBoolean)

    def setTensorboard(self: P, value: bool) -> P:
        """Sets :py:attr:`tensorboard`: start TensorBoard on the chief."""
        return self._set(tensorboard=value)

    def getTensorboard(self) -> bool:
        """:py:attr:`tensorboard`, or its default."""
        return self.getOrDefault(self.tensorboard)


class HasSteps(Params):
    steps: "Param[int]" = Param(
        Params._dummy(), "steps",
        'maximum training steps (passed to train_fn)',
        typeConverter=TypeConverters.toInt)

    def setSteps(self: P, value: int) -> P:
        """Sets :py:attr:`steps`: maximum training steps."""
        return self._set(steps=value)

    def getSteps(self) -> int:
        """:py:attr:`steps`, or its default."""
        return self.getOrDefault(self.steps)


class HasEpochs(Params):
    epochs: "Param[int]" = Param(
        Params._dummy(), "epochs",
        'times the DataFrame is fed',
        typeConverter=TypeConverters.toInt)

    def setEpochs(self: P, value: int) -> P:
        """Sets :py:attr:`epochs`: times the DataFrame is fed."""
        return self._set(epochs=value)

    def getEpochs(self) -> int:
        """:py:attr:`epochs`, or its default."""
        return self.getOrDefault(self.epochs)


class HasProtocol(Params):
    protocol: "Param[str]" = Param(
        Params._dummy(), "protocol",
        "TensorFlow's protocol, grpc|rdma (passed to train_fn)",
        typeConverter=TypeConverters.toString)

    def setProtocol(self: P, value: str) -> P:
        """Sets :py:attr:`protocol`: TensorFlow's protocol, grpc|rdma."""
        return self._set(protocol=value)

    def getProtocol(self) -> str:
        """:py:attr:`protocol`, or its default."""
        return self.getOrDefault(self.protocol)


class HasInputMode(Params):
    input_mode: "Param[int]" = Param(
        Params._dummy(), "input_mode",
        '1 = SPARK (fit feeds the DataFrame); 0 = TENSORFLOW (fit writes it as '
        'TFRecords to TFRecordDir and train_fn reads them)',
        typeConverter=TypeConverters.toInt)

    def setInputMode(self: P, value: int) -> P:
        """Sets :py:attr:`input_mode`: 1 (SPARK) or 0 (TENSORFLOW)."""
        return self._set(input_mode=value)

    def getInputMode(self) -> int:
        """:py:attr:`input_mode`, or its default."""
        return self.getOrDefault(self.input_mode)


class HasTFRecordDir(Params):
    tfrecord_dir: "Param[Optional[str]]" = Param(
        Params._dummy(), "tfrecord_dir",
        'where fit writes the DataFrame in InputMode.TENSORFLOW',
        typeConverter=_to_str_or_none)

    def setTFRecordDir(self: P, value: Optional[str]) -> P:
        """Sets :py:attr:`tfrecord_dir`: where fit writes the DataFrame in InputMode.TENSORFLOW."""
        return self._set(tfrecord_dir=value)

    def getTFRecordDir(self) -> Optional[str]:
        """:py:attr:`tfrecord_dir`, or its default."""
        return self.getOrDefault(self.tfrecord_dir)


class HasMasterNode(Params):
    master_node: "Param[Optional[str]]" = Param(
        Params._dummy(), "master_node",
        "job name of the chief ('chief'), or None for workers only",
        typeConverter=_to_str_or_none)

    def setMasterNode(self: P, value: Optional[str]) -> P:
        """Sets :py:attr:`master_node`: job name of the chief."""
        return self._set(master_node=value)

    def getMasterNode(self) -> Optional[str]:
        """:py:attr:`master_node`, or its default."""
        return self.getOrDefault(self.master_node)


class HasGraceSecs(Params):
    grace_secs: "Param[int]" = Param(
        Params._dummy(), "grace_secs",
        'seconds to wait after the nodes finished',
        typeConverter=TypeConverters.toInt)

    def setGraceSecs(self: P, value: int) -> P:
        """Sets :py:attr:`grace_secs`: seconds to wait after the nodes finished."""
        return self._set(grace_secs=value)

    def getGraceSecs(self) -> int:
        """:py:attr:`grace_secs`, or its default."""
        return self.getOrDefault(self.grace_secs)


class HasMaxRestarts(Params):
    max_restarts: "Param[int]" = Param(
        Params._dummy(), "max_restarts",
        'node failures that relaunch the cluster (train_fn resumes from its checkpoint)'
        ' before fit fails',
        typeConverter=TypeConverters.toInt)

    def setMaxRestarts(self: P, value: int) -> P:
        """Sets :py:attr:`max_restarts`: node failures that relaunch the cluster."""
        return self._set(max_restarts=value)

    def getMaxRestarts(self) -> int:
        """:py:attr:`max_restarts`, or its default."""
        return self.getOrDefault(self.max_restarts)


class HasReservationTimeout(Params):
    reservation_timeout: "Param[float]" = Param(
        Params._dummy(), "reservation_timeout",
        'seconds for all nodes to start',
        typeConverter=TypeConverters.toFloat)

    def setReservationTimeout(self: P, value: float) -> P:
        """Sets :py:attr:`reservation_timeout`: seconds for all nodes to start."""
        return self._set(reservation_timeout=value)

    def getReservationTimeout(self) -> float:
        """:py:attr:`reservation_timeout`, or its default."""
        return self.getOrDefault(self.reservation_timeout)


class HasGpusPerNode(Params):
    gpus_per_node: "Param[int]" = Param(
        Params._dummy(), "gpus_per_node",
        "GPUs Spark assigns to each node's task (0: none asked); the node sees "
        'exactly those (CUDA_VISIBLE_DEVICES); see ember.spark.run(gpus_per_node=)',
        typeConverter=TypeConverters.toInt)

    def setGpusPerNode(self: P, value: int) -> P:
        """Sets :py:attr:`gpus_per_node`: GPUs Spark assigns to each node's task."""
        return self._set(gpus_per_node=value)

    def getGpusPerNode(self) -> int:
        """:py:attr:`gpus_per_node`, or its default."""
        return self.getOrDefault(self.gpus_per_node)


class HasSignatureDefKey(Params):
    signature_def_key: "Param[Optional[str]]" = Param(
        Params._dummy(), "signature_def_key",
        'SavedModel signature; None: mappings name graph tensors',
        typeConverter=_to_str_or_none)

    def setSignatureDefKey(self: P, value: Optional[str]) -> P:
        """Sets :py:attr:`signature_def_key`: SavedModel signature."""
        return self._set(signature_def_key=value)

    def getSignatureDefKey(self) -> Optional[str]:
        """:py:attr:`signature_def_key`, or its default."""
        return self.getOrDefault(self.signature_def_key)


class HasTagSet(Params):
    tag_set: "Param[Optional[str]]" = Param(
        Params._dummy(), "tag_set",
        'comma-separated tags of the SavedModel MetaGraph',
        typeConverter=_to_str_or_none)

    def setTagSet(self: P, value: Optional[str]) -> P:
        """Sets :py:attr:`tag_set`: comma-separated tags of the SavedModel MetaGraph."""
        return self._set(tag_set=value)

    def getTagSet(self) -> Optional[str]:
        """:py:attr:`tag_set`, or its default."""
        return self.getOrDefault(self.tag_set)


class HasArrowPath(Params):
    arrow_path: "Param[Optional[str]]" = Param(
        Params._dummy(), "arrow_path",
        "how transform reaches the model: 'direct' (the executor JVM packs the input "
        "columns into a pipe to an Ember inference worker), 'udf' (an Arrow UDF, "
        "Spark >= 4.1: only the input columns cross to Python) or 'mapInArrow' (every"
        " column crosses and comes back); default: 'direct' where the DataFrame "
        "allows it, else 'udf' where available",
        typeConverter=_to_str_or_none)

    def setArrowPath(self: P, value: Optional[str]) -> P:
        """Sets :py:attr:`arrow_path`: how transform reaches the model."""
        return self._set(arrow_path=value)

    def getArrowPath(self) -> Optional[str]:
        """:py:attr:`arrow_path`, or its default."""
        return self.getOrDefault(self.arrow_path)
