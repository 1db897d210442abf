"""The TorchScript side of :class:`ember.ml.EmberTorchModel`: finding and
loading the module, matching the mappings to ``forward()``, the dry run that
types the outputs, and the predictor that :mod:`ember.ml._runtime` runs in
Spark's Python workers (the same cache, Arrow <-> numpy conversion and
batching as a SavedModel).

torch is imported here only, when a TorchScript model is used; nothing here
imports pyspark.  ExportDir may be on HDFS: paths (and the spec) keep the URL,
and the archive is read from the host's copy (:mod:`ember.ml._model_files`).
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ember import hdfs
from ember.ml import _model_files
from ember.ml._runtime import ModelInputError, TensorInfo

#: The file name ExportDir holds when it is a directory (``save_torchscript``
#: writes it; a train_fn may also ``torch.jit.save`` there itself).
TORCHSCRIPT_FILE = "model.pt"
#: The extra file of the archive with the declared inputs (see save_torchscript).
META_FILE = "ember.json"


def _import_torch() -> Any:
    import torch

    return torch


def _is_torchscript(path: str) -> bool:
    """A zip archive with TorchScript code (``<name>/code/...``), as torch.jit.save writes."""
    try:
        with zipfile.ZipFile(path) as z:
            return any("/code/" in n for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def torchscript_file(export_dir: str) -> Optional[str]:
    """The TorchScript archive of ``export_dir`` (the path itself when it is one,
    else ``export_dir/model.pt``), or None when there is none.  On HDFS, the
    archive's URL (checked in this host's copy)."""
    if _model_files.isfile(export_dir):
        path = export_dir
    elif _model_files.is_remote(export_dir):
        path = hdfs.join(export_dir.rstrip("/"), TORCHSCRIPT_FILE)
    else:
        path = os.path.join(_model_files.local_path(export_dir), TORCHSCRIPT_FILE)
    try:
        local = _model_files.model_file(path)[0]
    except FileNotFoundError:
        return None
    return path if _is_torchscript(local) else None


def require_file(export_dir: str) -> str:
    path = torchscript_file(export_dir)
    if path is None:
        what = "is not a TorchScript archive" if _model_files.isfile(export_dir) else \
            f"holds no TorchScript archive ({TORCHSCRIPT_FILE}, as torch.jit.save or " \
            "ember.ml.save_torchscript write it)"
        raise ModelInputError(f"ExportDir {export_dir!r} {what}")
    return path


def stamp(path: str) -> int:
    """The archive's modification time (ns; on HDFS, a stamp of its version):
    a re-exported model is reloaded."""
    return _model_files.model_file(path)[1]


def load(path: str) -> Tuple[Any, Dict[str, Any]]:
    """(the module in eval mode on the CPU, its declared inputs or {})."""
    torch = _import_torch()
    extra = {META_FILE: ""}
    local = _model_files.model_file(path)[0]
    try:
        module = torch.jit.load(local, map_location="cpu", _extra_files=extra)
    except RuntimeError as exc:
        raise ModelInputError(f"cannot load TorchScript {path}: {str(exc).splitlines()[0]}") from exc
    module.eval()
    meta: Dict[str, Any] = {}
    if extra[META_FILE]:
        meta = json.loads(extra[META_FILE])
    return module, meta


# --------------------------------------------------------------------------- forward()

def forward_arguments(module: Any) -> List[Tuple[str, str, bool]]:
    """(name, type, has a default) of each ``forward()`` argument after self."""
    schema = module.forward.schema
    return [(a.name, str(a.type), a.has_default_value()) for a in schema.arguments[1:]]


def _describe_forward(args: Sequence[Tuple[str, str, bool]]) -> str:
    return "forward(" + ", ".join(f"{n}: {t}" + ("=..." if d else "") for n, t, d in args) + ")"


def bind_inputs(module: Any, path: str, names: Sequence[str]) -> List[str]:
    """The ``forward()`` argument each InputMapping target names (an argument
    name, or its position ``"0"``, ``"1"``...).  Every argument without a
    default must be bound, each at most once, and only Tensor arguments."""
    args = forward_arguments(module)
    by_name = {n: (n, t) for n, t, _ in args}
    sig = _describe_forward(args)
    bound: List[str] = []
    for name in names:
        if name in by_name:
            arg, typ = by_name[name]
        elif name.isdigit() and int(name) < len(args):
            arg, typ = args[int(name)][0], args[int(name)][1]
        else:
            raise ModelInputError(f"model input {name!r} is not an argument of {sig} of {path} "
                                  "(map columns to argument names or positions '0', '1', ...)")
        if arg in bound:
            raise ModelInputError(f"two InputMapping columns map to argument {arg!r} of {sig}")
        if typ != "Tensor":
            raise ModelInputError(f"argument {arg!r} of {sig} is {typ}, not a Tensor: ember.ml "
                                  "passes each mapped column as a Tensor")
        bound.append(arg)
    unbound = [n for n, _, has_default in args if not has_default and n not in bound]
    if unbound:
        raise ModelInputError(f"{sig} of {path} needs argument(s) {unbound} that no "
                              "InputMapping column maps to")
    return bound


def _outputs_by_key(out: Any) -> Dict[str, Any]:
    """forward()'s result as {output key: value}: dict keys, or positions of a
    tuple/list ("0", "1", ...), or "0" for a single tensor."""
    if isinstance(out, dict):
        return {str(k): v for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return {str(i): v for i, v in enumerate(out)}
    return {"0": out}


def select_outputs(out: Any, keys: Sequence[str]) -> List[Any]:
    table = _outputs_by_key(out)
    return [table[k] for k in keys]


# --------------------------------------------------------------------------- predictor

def _info(d: Dict[str, Any]) -> TensorInfo:
    shape = d["shape"]
    return TensorInfo(d["key"], d["tensor"], np.dtype(d["dtype"]),
                      None if shape is None else tuple(shape))


def info_dict(info: TensorInfo) -> Dict[str, Any]:
    """A TensorInfo as the plain dict the inference spec carries to the workers."""
    return {"key": info.key, "tensor": info.tensor, "dtype": info.dtype.str,
            "shape": None if info.shape is None else list(info.shape)}


class TorchPredictor:
    """A loaded TorchScript module with the same interface as a SavedModel's
    predictor: ``inputs``/``outputs`` (TensorInfo, typed on the driver by the
    declared inputs or a dry run) and ``run(list of numpy) -> list of numpy``."""

    def __init__(self, spec: Dict[str, Any]) -> None:
        self.torch = _import_torch()
        self.module, _ = load(spec["export_dir"])
        self.args = list(spec["feeds"])
        self.keys = list(spec["fetches"])
        self.inputs = [_info(d) for d in spec["torch_inputs"]]
        self.outputs = [_info(d) for d in spec["torch_outputs"]]

    def run(self, arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        torch = self.torch
        kwargs = {}
        for arg, a in zip(self.args, arrays):
            # Arrow-backed arrays are read-only, and forward() may write to
            # its inputs (x.div_(255)): those are copied, cast ones are new
            kwargs[arg] = torch.from_numpy(a if a.flags.writeable else np.array(a))
        with torch.inference_mode():
            out = self.module(**kwargs)
        return [_to_numpy(y, k) for y, k in zip(select_outputs(out, self.keys), self.keys)]


def _to_numpy(y: Any, key: str) -> np.ndarray:
    torch = _import_torch()
    if not isinstance(y, torch.Tensor):
        raise ModelInputError(f"model output {key!r} is a {type(y).__name__}, not a Tensor")
    if y.dtype == torch.bfloat16:
        y = y.float()
    return y.detach().cpu().numpy()


# --------------------------------------------------------------------------- driver side

def declared_inputs(meta: Dict[str, Any], args: Sequence[str],
                    keys: Sequence[str]) -> Optional[List[TensorInfo]]:
    """The inputs' dtypes and shapes save_torchscript recorded, or None when the
    archive declares none (or not for every mapped argument)."""
    table = meta.get("inputs") or {}
    if not all(a in table for a in args):
        return None
    return [TensorInfo(k, a, np.dtype(table[a]["dtype"]), tuple(table[a]["shape"]))
            for k, a in zip(keys, args)]


def floating_dtype(module: Any) -> Optional[np.dtype]:
    """The dtype of the module's first floating-point parameter or buffer: what a
    column of floats or doubles is cast to (a float32 model takes double columns)."""
    torch = _import_torch()
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point() and t.dtype != torch.bfloat16:
            return np.dtype(str(t.dtype).replace("torch.", ""))
    return None


def dry_run(module: Any, path: str, args: Sequence[str], inputs: Sequence[TensorInfo],
            xs: Sequence[np.ndarray], keys: Sequence[str], columns: Sequence[str],
            where: str) -> List[TensorInfo]:
    """Calls forward() once on ``xs`` (one row, or zeros of the declared shapes)
    and types the requested outputs from what it returns; a failure names the
    columns' arguments, dtypes and shapes, and what forward() said."""
    torch = _import_torch()
    kwargs = {a: torch.from_numpy(np.array(x)) for a, x in zip(args, xs)}
    order = [n for n, _, _ in forward_arguments(module)]  # as forward() lists them
    given = ", ".join(f"{a}={x.dtype}[{', '.join(map(str, x.shape))}] from column {c!r}"
                      for a, x, c in sorted(zip(args, xs, columns),
                                            key=lambda t: order.index(t[0])))
    try:
        with torch.inference_mode():
            out = module(**kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's forward()
        msg = str(exc).strip().splitlines()
        reason = msg[-1] if msg else type(exc).__name__
        for line in msg:  # TorchScript's traceback ends with the Python error line
            if "Error:" in line or "error:" in line:
                reason = line.strip()
        raise ModelInputError(f"dry run of {path} on {where} failed: forward({given}): "
                              f"{reason}") from exc
    table = _outputs_by_key(out)
    missing = [k for k in keys if k not in table]
    if missing:
        raise ModelInputError(f"forward() of {path} has no output(s) {missing} (outputs: "
                              f"{sorted(table)}; a dict's keys, or positions of a tuple)")
    infos = []
    rows = xs[0].shape[0] if xs and xs[0].ndim else 1
    for k in keys:
        y = _to_numpy(table[k], k)
        if y.ndim == 0 or y.shape[0] != rows:
            raise ModelInputError(f"model output {k!r} has shape {list(y.shape)} for {rows} "
                                  "input row(s): outputs need the row axis first")
        infos.append(TensorInfo(k, k, y.dtype, (None, *y.shape[1:])))
    return infos


# --------------------------------------------------------------------------- export

def save_torchscript(module: Any, export_dir: str, example_inputs: Any = None,
                     method: str = "script") -> str:
    """Saves ``module`` as TorchScript for :class:`ember.ml.EmberTorchModel`;
    returns the archive's path (``export_dir/model.pt``).

    :param module: a ``torch.nn.Module`` (put in eval mode first) or an
        already scripted/traced one.
    :param example_inputs: a dict of ``forward()`` argument -> tensor, or a
        tuple of tensors in argument order, with a row axis first.  Needed for
        ``method="trace"``; when given, each input's dtype and row shape are
        recorded in the archive, so a transform checks columns against them
        before running anything, reshapes flat array columns to them (a
        ``784`` array to ``[1, 28, 28]``), and types the outputs without
        reading a row (which a streaming DataFrame cannot give).
    :param method: ``"script"`` (``torch.jit.script``) or ``"trace"``.

    The file is written to a temporary name and renamed, so a reader never
    sees half of it.  An ``hdfs://`` export_dir gets the archive the same
    way, written locally first (returns its URL).
    """
    torch = _import_torch()
    if method not in ("script", "trace"):
        raise ValueError(f"method must be 'script' or 'trace', not {method!r}")
    module = module.eval()
    scripted = isinstance(module, torch.jit.ScriptModule)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if method == "trace" and not scripted:
        if example_inputs is None:
            raise ValueError("method='trace' needs example_inputs")
        with torch.no_grad():
            if isinstance(example_inputs, dict):
                module = torch.jit.trace(module, example_kwarg_inputs=example_inputs) \
                    if "example_kwarg_inputs" in torch.jit.trace.__code__.co_varnames \
                    else torch.jit.trace(module, tuple(example_inputs.values()))
            else:
                module = torch.jit.trace(module, tuple(example_inputs))
    elif not scripted:
        module = torch.jit.script(module)
    meta: Dict[str, Any] = {}
    if example_inputs is not None:
        names = [n for n, _, _ in forward_arguments(module)]
        items = example_inputs.items() if isinstance(example_inputs, dict) \
            else zip(names, example_inputs)
        meta["inputs"] = {n: {"dtype": str(t.dtype).replace("torch.", ""),
                              "shape": [None, *[int(d) for d in t.shape[1:]]]}
                          for n, t in items}
    if _model_files.isfile(export_dir):
        raise ValueError(f"export_dir {export_dir!r} is a file; give a directory")
    if _model_files.is_remote(export_dir):  # saved here, then uploaded (renamed into place)
        import tempfile

        url = hdfs.join(export_dir.rstrip("/"), TORCHSCRIPT_FILE)
        with tempfile.TemporaryDirectory(prefix="ember-torchscript-") as tmp:
            _jit_save(torch, module, meta, os.path.join(tmp, TORCHSCRIPT_FILE))
            hdfs.upload(os.path.join(tmp, TORCHSCRIPT_FILE), url)
        return url
    export_dir = _model_files.local_path(export_dir)
    os.makedirs(export_dir, exist_ok=True)
    path = os.path.join(export_dir, TORCHSCRIPT_FILE)
    _jit_save(torch, module, meta, path)
    return path


def _jit_save(torch: Any, module: Any, meta: Dict[str, Any], path: str) -> None:
    """``torch.jit.save`` to a temporary name, then renamed over ``path``."""
    tmp = path + f".tmp{os.getpid()}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(module, tmp, _extra_files={META_FILE: json.dumps(meta)})
    os.replace(tmp, path)
