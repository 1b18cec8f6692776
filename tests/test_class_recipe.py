"""A class is one unit: nothing outside mixc/classes asks which class a state is by its name.

Code above the classes asks the unit (`classes.unit(name).<attribute>`) what it needs to know;
a comparison with a class's name (`st.transition == SCALAR`, `== "rank-1 correction"`) outside
mixc/classes is what made the rank-r class touch 25 files. Every module of mixc is read with
ast: a use of a class-name constant of mixc.classes (imported, or as an attribute of a module
that re-exports it) or a string equal to a unit's name fails here."""
import ast
from pathlib import Path

import pytest

import mixc
from mixc import classes

ROOT = Path(mixc.__file__).resolve().parent
CLASS_DIR = ROOT / "classes"
# mixc.classes' constants that name one class (CHUNK_CLASSES, a capability list, is not one)
NAME_CONSTANTS = {n for n in classes.__all__ if isinstance(getattr(classes, n), str)} - {"STABILIZED_CLASS", "SYSTEM_CLASS"}
UNIT_NAMES = {u.name for u in classes.CLASSES}


def _modules():
    return sorted(p for p in ROOT.rglob("*.py") if CLASS_DIR not in p.parents)


def _class_names_used(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in ("classes", "plan"):
            imported |= {a.asname or a.name for a in node.names if a.name in NAME_CONSTANTS}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in imported:
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in NAME_CONSTANTS and isinstance(node.value, ast.Name) \
                and node.value.id in ("classes", "P", "plan"):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in UNIT_NAMES:
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_class_named_outside_the_units(path):
    found = _class_names_used(path)
    assert not found, f"{path.relative_to(ROOT)} asks for a class by name (ask the unit instead): {found}"


def test_the_check_finds_a_comparison(tmp_path):
    """The check itself fails on what it forbids."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ..classes import SCALAR\nfrom ..derive import plan as P\n"
                   "def f(st):\n    return st.transition == SCALAR or st.transition == P.RANK1 "
                   f"or st.transition == {classes.CLASSES[0].name!r}\n")
    assert len(_class_names_used(bad)) == 3
