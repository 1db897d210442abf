"""The docs keep up with the code: docs/architecture.md names every source
module that exists, so a new engineer finds each one described there."""

from __future__ import annotations

import pathlib
from typing import List

REPO = pathlib.Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"


def _sources() -> List[pathlib.Path]:
    c = [*(REPO / "csrc").glob("*.[ch]"), *(REPO / "csrc" / "include" / "ember").glob("*.h"),
         *(REPO / "python" / "ember").glob("_ember*.[ch]")]
    py = [p for p in (REPO / "python" / "ember").rglob("*.py") if p.name != "__init__.py"]
    return sorted(c + py)


def _names(path: pathlib.Path) -> List[str]:
    """How docs/architecture.md may name a source: a C file by its file name
    (`coll_mesh.c`), a Python module by its module name (`driver`, `_params`),
    its path in the package (`yarn/_tracking`) or its dotted path
    (`ember.ml._params`)."""
    if path.suffix in (".c", ".h"):
        return [path.name]
    rel = path.relative_to(REPO / "python").with_suffix("")
    return [path.stem, "/".join(rel.parts[1:]), ".".join(rel.parts)]


def test_architecture_names_every_source_module():
    text = ARCHITECTURE.read_text()
    missing = [str(p.relative_to(REPO)) for p in _sources()
               if not any(f"`{name}`" in text for name in _names(p))]
    assert not missing, (f"docs/architecture.md does not name {missing}: add a line for "
                         "each saying what it does and where it runs")


def test_the_check_sees_the_sources():
    # a glob gone wrong must not make the test above pass by finding nothing
    names = {p.name for p in _sources()}
    assert {"acceptor.c", "feed.h", "_ember_coll.c", "driver.py", "_params.py"} <= names
