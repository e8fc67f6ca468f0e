"""The weight a reader copies: each train.py and every project file it imports, sibling modules (imported by plain
name) and common/ included; the minimal copy without common/hardening/; main() short and flat."""

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

LIMITS = {"cifar_resnet": (1900, 1400), "imagenet": (2300, None), "transformer": (2600, None)}  # full, minimal
CORE_LIMIT = 600  # common/ without common/hardening/


def imports(path: Path) -> set[Path]:
    """The project files ``path`` imports: common.* (absolute), its package's (relative), its folder's (by name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:  # from . import checks, launch
            base = path.parent
            names = [str((base / (node.module or "")).relative_to(REPO)).replace("/", ".") + f".{a.name}"
                     for a in node.names]  # fmt: skip
        elif isinstance(node, ast.ImportFrom):
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        for name in names:
            for candidate in (REPO / name.replace(".", "/"), path.parent / name):
                for file in (candidate.with_suffix(".py"), candidate / "__init__.py"):
                    if file.is_file():
                        found.add(file)
    return found


def copy_of(script: Path, skip: str = "") -> set[Path]:
    seen, todo = set(), [script]
    while todo:
        p = todo.pop()
        if p not in seen and not (skip and str(p.relative_to(REPO)).startswith(skip)):
            seen.add(p)
            todo.extend(imports(p))
    return seen


def lines(files) -> int:
    return sum(len(f.read_text().splitlines()) for f in files)


@pytest.mark.parametrize("folder", LIMITS)
def test_each_copy_within_its_weight(folder):
    script = REPO / folder / "train.py"
    full, minimal = copy_of(script), copy_of(script, skip="common/hardening/")
    assert {f.parent.name for f in full} >= {folder, "common", "hardening"}  # the walk finds them all
    assert len(script.read_text().splitlines()) <= 400
    assert lines(full) <= LIMITS[folder][0], (lines(full), sorted(str(f.relative_to(REPO)) for f in full))
    assert LIMITS[folder][1] is None or lines(minimal) <= LIMITS[folder][1], lines(minimal)
    main = next(n for n in ast.parse(script.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= 150
    assert not [n for n in ast.walk(main) if isinstance(n, (ast.FunctionDef, ast.Lambda)) and n is not main]


def test_the_core_is_small_and_never_reaches_for_the_hardening():
    core = sorted((REPO / "common").glob("*.py"))
    assert lines(core) <= CORE_LIMIT
    assert not [f.name for f in core if any("hardening" in str(p) for p in imports(f))]
