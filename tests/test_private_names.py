"""No private name crosses a module (issue 26 item 2: one public builder module per job, "no
private helpers imported across modules").

A name that starts with one underscore is its module's own: another dpsql module that imports
it depends on a detail its owner may change without looking. A name two modules share is made
public where it is defined (a docstring saying what it promises), or the code that needs it
moves to its owner. None remains (KNOWN_PRIVATE_IMPORTS below is empty): the test fails on a
new one and on a record that no longer exists (an AST walk of dpsql/, lazy imports
included, well under a second).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "dpsql"

#: (importing module, imported module, name) still importing a private name: none left.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()  # keep it so


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(root: Path = ROOT) -> set[tuple[str, str, str]]:
    """Every ``from dpsql.x import _name`` under ``root``, and every ``m._name`` read through
    a dpsql module imported as ``m`` (``from dpsql.engine import prepared``, ``import
    dpsql.lower.compile as c``); ``__dunder__`` names are not private."""
    modules = {
        ".".join(p.relative_to(root.parent).with_suffix("").parts) for p in root.rglob("*.py")
    }
    found = set()
    for path in sorted(root.rglob("*.py")):
        module = str(path.relative_to(root.parent))
        tree = ast.parse(path.read_text(), filename=module)
        named: dict[str, str] = {}  # local name -> the dpsql module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpsql"):
                for alias in node.names:
                    if _private(alias.name):
                        found.add((module, str(node.module), alias.name))
                    if f"{node.module}.{alias.name}" in modules:
                        named[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("dpsql") and alias.asname:
                        named[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in named
                and _private(node.attr)
            ):
                found.add((module, named[node.value.id], node.attr))
    return found


def test_no_new_private_import_across_modules() -> None:
    new = private_imports() - KNOWN_PRIVATE_IMPORTS
    assert not new, (
        f"private names imported from another module: {sorted(new)}; make the name public "
        "where it is defined (and say what it promises), or move the code that needs it there"
    )


def test_the_record_of_private_imports_is_current() -> None:
    gone = KNOWN_PRIVATE_IMPORTS - private_imports()
    assert not gone, f"no longer imported, remove from KNOWN_PRIVATE_IMPORTS: {sorted(gone)}"


def test_the_walk_sees_private_imports(tmp_path: Path) -> None:
    """The rule sees a private import inside a function (a lazy one) and a private name read
    through an imported module, not a dunder."""
    package = tmp_path / "dpsql"
    package.mkdir()
    (package / "a.py").write_text(
        "from dpsql import b\nfrom dpsql.b import __version__\n\n"
        "def f():\n    from dpsql.plan.values import _hidden\n    return b._inner, b.__doc__\n"
    )
    (package / "b.py").write_text("_inner = 1\n")
    assert private_imports(package) == {
        ("dpsql/a.py", "dpsql.plan.values", "_hidden"),
        ("dpsql/a.py", "dpsql.b", "_inner"),
    }
