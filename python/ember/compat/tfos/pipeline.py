"""TensorFlowOnSpark's ``pipeline.TFEstimator`` / ``pipeline.TFModel`` on Ember.

Thin layers over :mod:`ember.ml` (``EmberEstimator`` / ``EmberModel``) with
TFoS's constructors and defaults (``TFEstimator(train_fn, tf_args,
export_fn=None)``, ``master_node='chief'``, ``grace_secs=30``, ``batch_size=100``,
``epochs=1``, ``steps=1000``...).  ``train_fn(args, ctx)`` gets TFoS's ctx
(``ctx.mgr``, ``TFNode.DataFeed(ctx.mgr, True, input_mapping=...)``,
``ctx.absolute_path``); the InputMapping's columns are fed in sorted column
order, as TFoS did, so ``next_batch`` with ``input_mapping`` returns a dict of
tensor -> column.  ``TFModel.transform(df)`` runs the SavedModel in Spark's
Python workers (see :class:`ember.ml.EmberModel`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Dict, Optional, Union

from ember.compat.tfos import _node
from ember.ml import EmberEstimator, EmberModel

__all__ = ["TFEstimator", "TFModel"]


class TFEstimator(EmberEstimator):
    """TFoS's ``TFEstimator(train_fn, tf_args, export_fn=None)``."""

    def __init__(self, train_fn: Optional[Callable[[Any, Any], Any]] = None,
                 tf_args: Union[argparse.Namespace, Dict[str, Any], None] = None,
                 export_fn: Optional[Callable[[Any], Any]] = None) -> None:
        # TFoS's train_fn reads args as attributes (args.batch_size) even from a dict
        if isinstance(tf_args, dict):
            tf_args = argparse.Namespace(**tf_args)
        super().__init__(train_fn, tf_args)
        self.export_fn = export_fn
        self._setDefault(master_node="chief", grace_secs=30)  # TFoS's defaults on TF 2

    def _fit(self, dataset: Any) -> Any:
        from ember.compat.tfos.TFCluster import _default_fs

        fn = self.train_fn
        if fn is None:
            raise ValueError("TFEstimator has no train_fn")
        sc = dataset.sparkSession.sparkContext
        # ember.ml feeds through ember.spark's train(), whose queue is "input"
        self.train_fn = _node.wrap_main(fn, self.getMasterNode(), _default_fs(sc), os.getcwd(),
                                        ["input", "output", "error"])
        try:
            model = super()._fit(dataset)
        finally:
            self.train_fn = fn
        if self.export_fn is not None:
            raise Exception("Please use native TF2.x APIs to export a saved_model.")
        return model

    def _node_env(self, sc: Any) -> Dict[str, str]:
        """The nodes' environment of ``TFCluster.run``: tf_keras for TFoS's TF 2
        Keras programs (``TF_USE_LEGACY_KERAS``, see ``TFCluster._node_env``)."""
        from ember.compat.tfos.TFCluster import _node_env

        return _node_env(sc)


class TFModel(EmberModel):
    """TFoS's ``TFModel(tf_args)``: batched inference with the exported SavedModel."""

    def __init__(self, tf_args: Union[argparse.Namespace, Dict[str, Any], None] = None) -> None:
        super().__init__(tf_args)
        # TFoS's TFModel defaults (its examples set SignatureDefKey/TagSet explicitly)
        self._setDefault(batch_size=100, signature_def_key=None, tag_set=None)
