"""ember._imports: a heavy framework's import runs with the cyclic collector
paused, and the process is as before afterwards.  Each case runs in a fresh
Python whose path starts with stand-in packages named like heavy
frameworks (``jax``, ``keras``, ``transformers``), so what the import sees
is recorded without importing a real framework."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _in_fresh_python(tmp_path: Any, script: str) -> Dict[str, Any]:
    jax = tmp_path / "jax"
    jax.mkdir()
    (jax / "__init__.py").write_text(
        "import gc\nON_AT_IMPORT = gc.isenabled()\n"
        "cycles = []\nfor _ in range(20000):\n    a = []\n    a.append(a)\n    cycles.append(a)\n"
        "from jax import sub\n")
    (jax / "sub.py").write_text("import gc\nON_AT_IMPORT = gc.isenabled()\n")
    (jax / "data.txt").write_text("resource")
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(
        "import gc\nassert not gc.isenabled()\nraise ImportError('no backend found')\n")
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text("import gc\nON_AT_IMPORT = gc.isenabled()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), os.path.join(REPO, "python")]))
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_heavy_import_runs_with_the_collector_paused_then_frozen(tmp_path):
    seen = _in_fresh_python(tmp_path, """
import gc, importlib.resources, importlib.util, json, sys
from ember._imports import pause_collector_on_heavy_imports
pause_collector_on_heavy_imports()
pause_collector_on_heavy_imports()
finders = [type(f).__name__ for f in sys.meta_path].count("_HeavyImportFinder")
assert importlib.util.find_spec("jax") is not None  # a look, not an import
frozen = gc.get_freeze_count()
import jax
out = dict(finders=finders, on_at_import=jax.ON_AT_IMPORT, sub=jax.sub.ON_AT_IMPORT,
           on_after=gc.isenabled(), frozen=gc.get_freeze_count() - frozen,
           loader=type(jax.__loader__).__name__, spec_loader=type(jax.__spec__.loader).__name__,
           resource=importlib.resources.files("jax").joinpath("data.txt").read_text())
frozen = gc.get_freeze_count()
try:
    import transformers
except ImportError as exc:
    out.update(failed=str(exc), on_after_failure=gc.isenabled(),
               frozen_by_failure=gc.get_freeze_count() - frozen)
gc.disable()  # the program's own choice stays
import keras
out.update(keras_on_at_import=keras.ON_AT_IMPORT, stays_off=not gc.isenabled())
print(json.dumps(out))
""")
    assert seen["finders"] == 1
    assert seen["on_at_import"] is False and seen["sub"] is False
    assert seen["on_after"] is True
    assert seen["frozen"] >= 20000  # what the import made (its 20,000 lists among it)
    # the module keeps its own loader (its resources, its reload)
    assert seen["loader"] == seen["spec_loader"] == "SourceFileLoader"
    assert seen["resource"] == "resource"
    assert seen["failed"] == "no backend found"
    assert seen["on_after_failure"] is True and seen["frozen_by_failure"] == 0
    assert seen["keras_on_at_import"] is False and seen["stays_off"] is True


def test_without_the_hook_and_around_a_model_load_nothing_is_frozen(tmp_path):
    seen = _in_fresh_python(tmp_path, """
import gc, json
from ember._imports import collector_paused
import jax
out = dict(on_at_import=jax.ON_AT_IMPORT, frozen=gc.get_freeze_count())
with collector_paused():
    out["paused"] = not gc.isenabled()
    with collector_paused():
        pass
    out["nested_leaves_it_paused"] = not gc.isenabled()
out.update(on_after=gc.isenabled(), frozen_after=gc.get_freeze_count())
print(json.dumps(out))
""")
    assert seen["on_at_import"] is True and seen["frozen"] == 0
    assert seen["paused"] and seen["nested_leaves_it_paused"]
    assert seen["on_after"] is True and seen["frozen_after"] == 0
