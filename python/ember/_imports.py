"""The heavy frameworks imported with Python's cyclic garbage collector paused.

Importing TensorFlow creates about half a million Python objects that live
as long as the process.  While they are being created, the cyclic collector
keeps running full passes over the growing heap and finds nothing to free:
those passes are about a third of the import's CPU time (``import
tensorflow``: 4.4 CPU s, 3.1 with the collector paused; ``import torch``:
2.9 and 2.4).  A node, a YARN task or an inference worker imports its
framework once, on the way to its first step, so every node of every job
paid that.

The processes Ember starts to run a user's code (a node,
:mod:`ember._trainer`; a YARN task, :mod:`ember.yarn.task`) call
:func:`pause_collector_on_heavy_imports` first thing: from then on, the
first import of one of :data:`HEAVY` (wherever it happens: ``main_fun``, a
module it imports, a library it calls) runs with the collector paused,
and the collector is back on, as it was, once that import returns or
raises.  Once such an import has succeeded, what the process holds then
(mostly what the import made, which lives as long as the process) is moved
out of the collector's sight (:func:`gc.freeze`), so that later full passes
do not go over it again.  Nothing else changes: reference counting frees
objects as ever (frozen ones too), the collector runs as usual on what the
program makes after, and a process whose code turned the collector off
keeps it off.  Where Ember loads a model (EmberModel's inference, in a
Spark Python worker or an inference worker, which may later load another
model in its place), the load runs in :func:`collector_paused`, and nothing
is frozen: the collector is as it was once the model is loaded.
"""

from __future__ import annotations

import dis
import functools
import gc
import importlib.abc
import importlib.machinery
import inspect
import sys
import sysconfig
from contextlib import contextmanager
from types import CodeType, ModuleType
from typing import Any, Dict, Iterator, Optional, Sequence, Set, Tuple

__all__ = ["HEAVY", "cloudpickle", "collector_paused", "frameworks_of",
           "pause_collector_on_heavy_imports"]

#: The top-level packages whose import is paced by the collector's passes.
HEAVY = frozenset({"tensorflow", "keras", "tf_keras", "torch", "jax", "transformers"})


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off for the block, and on again after it if it
    was on before (nested blocks and other threads' pauses leave it to the
    outermost one)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _PausingLoader(importlib.abc.Loader):
    """The module's own loader, its ``exec_module`` run with the collector
    paused; the module and its spec get their own loader back before their
    code runs (code that inspects ``__loader__`` sees the real one)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        with collector_paused():
            self._loader.exec_module(module)
        # what the import made lives as long as the process: left with the
        # collector, its first passes after the import would each go over it
        # again (a node importing TensorFlow and Keras, then training a few
        # steps: 7.4 CPU s, 6.5 with the import paused, 6.1 with it frozen too)
        gc.freeze()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _HeavyImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it for a heavy
    package's spec and wraps its loader in a :class:`_PausingLoader`."""

    def find_spec(self, name: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Any:
        if name not in HEAVY or not gc.isenabled():  # paused already: an import within
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PausingLoader(spec.loader)
                return spec
        return None


def cloudpickle() -> Any:
    """The cloudpickle that Ember pickles code for its own processes with
    (a node's boot record, a YARN task's ``experiment_fn``): the standalone
    package where it is installed, whose pickles load with it alone;
    pyspark's vendored copy otherwise, whose pickles of code pickled by
    value (a lambda, a closure, a function of ``__main__``) make the loading
    process import pyspark (about 0.4 CPU s, in each node spawned, not
    forked); plain pickle where neither is."""
    try:
        import cloudpickle as standalone
        return standalone
    except ImportError:
        pass
    try:
        from pyspark import cloudpickle as vendored
        return vendored
    except ImportError:
        import pickle
        return pickle


def pause_collector_on_heavy_imports() -> None:
    """From now on, the import of any of :data:`HEAVY` in this process runs
    with the collector paused (idempotent)."""
    if not any(isinstance(f, _HeavyImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _HeavyImportFinder())


def _source_of(name: str) -> Optional[str]:
    """Where module ``name`` is, found without importing it or its packages
    (``importlib.util.find_spec`` imports a dotted name's parents, and a
    package's ``__init__`` may do anything)."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None)
    spec, parts = None, name.split(".")
    for i in range(len(parts)):
        if i and (spec is None or not spec.submodule_search_locations):
            return None
        path = list(spec.submodule_search_locations) if i else None
        try:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), path)
        except (ImportError, ValueError):
            return None
    return getattr(spec, "origin", None)


def frameworks_of(fn: Any, depth: int = 3, args: Any = None) -> Tuple[str, ...]:
    """The packages of :data:`HEAVY` that ``fn`` (a job's ``main_fun``)
    imports, as far as its code says: the imports in its body and in the
    functions nested in it, the modules it names as globals, and the same
    in the functions it calls by a global name or holds in a closure
    (``depth`` calls deep); what Ember's modules it imports import at
    their top level; and what any code of the user's modules it imports
    imports (not of the standard library's or of an installed package's).
    The same for the functions ``args`` (the job's ``args``) holds, as values
    of a dict or items of a list or tuple, one level deep: a ``main_fun``
    that calls a function it is given, as ``run_task(args["experiment_fn"],
    ctx)`` does, imports what that function imports.
    These are what its node's fork server imports (:mod:`ember._forkserver`);
    a framework imported some other way is imported by the node itself."""
    found: Set[str] = set()
    seen: Set[int] = set()
    scanned: Set[str] = set()
    installed = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}

    def visit_value(value: Any, left: int) -> None:
        if isinstance(value, functools.partial):
            value = value.func
        if inspect.ismodule(value):
            visit_import(value.__name__, left)
        elif inspect.isfunction(value) and left > 0 and id(value) not in seen:
            seen.add(id(value))
            visit_code(value.__code__, value.__globals__, left - 1)
            for cell in value.__closure__ or ():
                try:
                    visit_value(cell.cell_contents, left - 1)
                except ValueError:  # an empty cell
                    pass

    def visit_code(code: CodeType, globs: Optional[Dict[str, Any]], left: int,
                   nested: bool = True) -> None:
        fromlist: Any = None
        for ins in dis.get_instructions(code):
            if ins.opname == "IMPORT_NAME":
                visit_import(str(ins.argval), left)
                # from package import module: the names may be modules
                for item in fromlist if isinstance(fromlist, tuple) else ():
                    if isinstance(item, str) and item != "*":
                        visit_import(f"{ins.argval}.{item}", left)
            elif ins.opname == "LOAD_GLOBAL" and globs is not None:
                visit_value(globs.get(str(ins.argval)), left)
            fromlist = ins.argval if ins.opname == "LOAD_CONST" else None
        for const in code.co_consts if nested else ():
            if isinstance(const, CodeType):
                visit_code(const, globs, left)

    def visit_import(name: str, left: int) -> None:
        top = name.partition(".")[0]
        if top in HEAVY:
            found.add(top)
            return
        if left <= 0 or name in scanned or top == "__future__":
            return
        scanned.add(name)
        origin = _source_of(name) or ""
        if not origin.endswith(".py") or (
                top != "ember" and any(origin.startswith(p + "/") for p in installed if p)):
            return
        try:
            with open(origin, encoding="utf-8") as f:
                code = compile(f.read(), origin, "exec")
        except (OSError, SyntaxError, ValueError):
            return
        # Ember's modules: what importing them imports (their top-level
        # statements; their functions import a framework each only when
        # called); the user's: what any of their code imports (main_fun
        # may call any of it, as module.function, beyond this scan's sight)
        visit_code(code, None, left - 1, nested=top != "ember")

    visit_value(fn, depth + 1)
    given = list(args.values()) if isinstance(args, dict) else \
        list(args) if isinstance(args, (list, tuple)) else []
    for value in given:
        visit_value(value, depth + 1)
    return tuple(sorted(found))
