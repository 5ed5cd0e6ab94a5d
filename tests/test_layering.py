"""The import graph of dpsql/, lazy imports included: a ratchet towards a layered package.

Data flows one way (text -> bound tree -> plan -> engine SQL -> aggregates -> release -> rows),
and so should imports: front doors call the service, the service never imports a front door,
engines never import the privacy layer, and no module reaches back up through a cycle. The
one strongly connected component of 44 modules (imports made inside functions hid it) is
gone: KNOWN_CYCLES below is empty. These tests fail on any cycle, on a new upstream import,
and on a stale record.

Every ``import`` and ``from ... import`` anywhere in a module counts, at module level or inside
a function (a lazy import is still a dependency: it only hides the cycle from the interpreter).
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "dpsql"

#: Front doors: what an analyst or a program talks to. Nothing below them imports them.
DOORS = (
    "dpsql.__main__",
    "dpsql.dbapi",
    "dpsql.cli",
    "dpsql.commands",
    "dpsql.cli_output",
    "dpsql.shell",
    "dpsql.server",
    "dpsql.sqlalchemy_dialect",
    "dpsql.curation",
    "dpsql.admin",
)

#: The wire server and the command line: doors over the service's session
#: (dpsql.service.session), each built on the service alone (issue 26 item 5).
SERVER_AND_CLI = (
    "dpsql.server",
    "dpsql.cli",
    "dpsql.commands",
    "dpsql.cli_output",
    "dpsql.shell",
    "dpsql.plots",
)
#: The PEP 249 door, and the SQLAlchemy dialect built on it (PEP 249 is a dialect's contract).
DBAPI_DOORS = ("dpsql.dbapi", "dpsql.sqlalchemy_dialect")

#: The import cycles that remain: none since issue 26 removed the last (keep it empty).
KNOWN_CYCLES: list[set[str]] = []  # none left: keep it so

#: Upstream imports that remain: (importer, imported door).
KNOWN_UPSTREAM: set[tuple[str, str]] = set()  # none left: keep it so


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once per run (several tests walk every module)."""
    return ast.parse(path.read_text())


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, mods) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the dpsql modules it imports anywhere in its text."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in mods.items():
        for node in ast.walk(_parsed(path)):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(module, path, node, mods):
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != module and target.startswith("dpsql."):
                    graph[module].add(target)
        graph.setdefault(module, set())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _is_door(module: str) -> bool:
    """A front door, or the package itself (``dpsql.connect``: the facade over the DB-API)."""
    return module == "dpsql" or any(module == d or module.startswith(d + ".") for d in DOORS)


def test_no_new_import_cycle_and_none_grows():
    for component in cycles(import_graph()):
        assert any(component <= known for known in KNOWN_CYCLES), (
            "an import cycle that is not (within) a recorded one: "
            f"{sorted(component)}; import downwards only (pass what a lower module needs as "
            "an argument, or move the shared piece down)"
        )


def test_the_record_of_cycles_is_current():
    """A module that left a cycle is removed from KNOWN_CYCLES, so the debt only shrinks."""
    now = cycles(import_graph())
    for known in KNOWN_CYCLES:
        still = set().union(*(c & known for c in now)) if now else set()
        assert still == known, f"no longer in a cycle, remove from KNOWN_CYCLES: {known - still}"


def test_nothing_below_the_doors_imports_a_door():
    graph = import_graph()
    upstream = {
        (a, b) for a, targets in graph.items() for b in targets if not _is_door(a) and _is_door(b)
    }
    assert upstream <= KNOWN_UPSTREAM, (
        f"imports of a front door: {sorted(upstream - KNOWN_UPSTREAM)}"
    )
    assert upstream >= KNOWN_UPSTREAM, f"stale: {sorted(KNOWN_UPSTREAM - upstream)}"


def test_engines_never_import_the_privacy_layer():
    graph = import_graph()
    bad = {
        (a, b)
        for a, targets in graph.items()
        if a.startswith("dpsql.engine")
        for b in targets
        if b.startswith("dpsql.privacy")
    }
    assert not bad, f"engines import the privacy layer: {sorted(bad)}"


def test_the_graph_sees_lazy_imports(tmp_path):
    """The walker finds an import made inside a function (the kind that hid the cycle)."""
    graph = import_graph()
    # imported inside Service._default_ledger
    assert "dpsql.privacy.sqlite_ledger" in graph["dpsql.pipeline"]


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """``start`` and every module it imports, directly or through others."""
    seen, stack = {start}, [start]
    while stack:
        for target in graph.get(stack.pop(), ()):
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


@functools.cache
def _package_names(path: Path) -> frozenset[str]:
    """Names a module takes from the package itself, which the import graph leaves out:
    ``from dpsql import X`` (X not a submodule) and ``dpsql.X`` after ``import dpsql`` (the
    package's lazy names, ``dpsql.connect`` and ``dpsql.Service`` among them)."""
    tree = _parsed(path)
    names: set[str] = set()
    plain = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "dpsql" and not node.level:
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            plain |= any(a.name == "dpsql" and a.asname is None for a in node.names)
    if plain:
        names.update(
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "dpsql"
        )
    return frozenset(names)


def test_the_server_and_the_cli_are_not_built_on_the_dbapi():
    """The wire server and the CLI open sessions over the service: neither they nor anything
    they import reaches the DB-API (or the dialect over it), lazily or through the package's
    ``dpsql.connect`` / ``dpsql.Service``; and the DB-API reaches neither of them."""
    import dpsql

    dbapi_names = {name for name, module in dpsql._LAZY.items() if module in DBAPI_DOORS}
    graph, paths = import_graph(), _modules()
    doors = [m for m in graph if _within(m, SERVER_AND_CLI)]
    assert "dpsql.server.backend" in doors and "dpsql.commands" in doors
    for door in doors:
        reached = _reach(graph, door)
        hit = sorted(m for m in reached if _within(m, DBAPI_DOORS))
        assert not hit, (
            f"{door} imports {hit}, directly or through another module: open a "
            "dpsql.service.session.Session over the service instead"
        )
        for module in reached:
            used = _package_names(paths[module]) & dbapi_names
            assert not used, (
                f"{module} (imported by {door}) uses dpsql.{sorted(used)[0]}, the DB-API's: "
                "use dpsql.pipeline.Service and dpsql.service.session instead"
            )
    for door in DBAPI_DOORS:
        back = {m for m in _reach(graph, door) if _within(m, SERVER_AND_CLI)}
        assert not back, f"{door} imports {sorted(back)}: a door is built on the service only"


def test_the_server_and_the_cli_are_not_built_on_each_other():
    """Neither of the two reaches the other (the statement splitter they share is
    dpsql.frontend.sqltext, below both). ``dpsql`` (dpsql.cli) finds ``dpsql serve``'s subcommands
    by module name, at run time, which is no import."""
    graph = import_graph()
    server = ("dpsql.server",)
    cli = ("dpsql.cli", "dpsql.commands", "dpsql.cli_output", "dpsql.shell")
    for module in graph:
        for mine, other in ((server, cli), (cli, server)):
            if _within(module, mine):
                hit = sorted(m for m in _reach(graph, module) if _within(m, other))
                assert not hit, f"{module} imports {hit}: each door is built on the service"


def test_the_rule_sees_the_package_names(tmp_path):
    """The check finds ``dpsql.connect`` after ``import dpsql`` and ``from dpsql import
    Service``, and ignores a submodule import and another name's attribute."""
    path = tmp_path / "door.py"
    path.write_text(
        "import dpsql\nfrom dpsql import Service, errors\nimport os\n"
        "def f():\n    return dpsql.connect(), os.path\n"
    )
    assert _package_names(path) == {"connect", "Service", "errors"}


#: The query's flow, folder by folder: text -> bound tree (frontend) -> annotated plan (plan)
#: -> engine SQL and column programs (lower) -> engines (engine) -> the release transaction
#: (service, pipeline). A stage reads the values of the stages before it, never one after it.
FLOW = ("dpsql.frontend", "dpsql.plan", "dpsql.lower", "dpsql.engine", "dpsql.service")

#: Imports against the flow that remain: (importer, imported).
KNOWN_AGAINST_FLOW: set[tuple[str, str]] = {
    # the compiler finds the store the engine holds for a plan's table and data version
    # (the layout itself is a value of the lowerings: dpsql.lower.store_layout)
    ("dpsql.lower.compile", "dpsql.engine.prepared"),
}


def _stage(module: str) -> int | None:
    if module == "dpsql.pipeline":
        return FLOW.index("dpsql.service")
    return next((i for i, f in enumerate(FLOW) if _within(module, (f,))), None)


def test_imports_follow_the_flow_of_a_query():
    graph = import_graph()
    against = set()
    for importer, targets in graph.items():
        here = _stage(importer)
        for target in targets:
            there = _stage(target)
            if here is not None and there is not None and there > here:
                against.add((importer, target))
    assert against <= KNOWN_AGAINST_FLOW, (
        f"imports against the flow {' -> '.join(FLOW)}: {sorted(against - KNOWN_AGAINST_FLOW)}; "
        "move the shared piece to the earlier stage or pass it in as an argument"
    )
    assert against >= KNOWN_AGAINST_FLOW, f"stale: {sorted(KNOWN_AGAINST_FLOW - against)}"


def test_the_flow_check_sees_an_import_against_it():
    graph = {"dpsql.plan.x": {"dpsql.lower.y"}, "dpsql.lower.y": {"dpsql.plan.x"}}
    assert [(a, b) for a, bs in graph.items() for b in bs if _stage(b) > _stage(a)] == [
        ("dpsql.plan.x", "dpsql.lower.y")
    ]
