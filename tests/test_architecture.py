"""The direction table of docs/architecture.md, checked against the import graph of every ``.py`` file.

The graph is read from the source with :mod:`ast`; nothing is imported. Importing would cost torch, grpc and ray
and would still miss the imports inside functions that never ran, while the AST sees every import statement: at
module level, inside functions, under ``TYPE_CHECKING``, and ``importlib.import_module("...")`` with a literal
name. The table lives here, as data, once; docs/architecture.md shows it to people, and a test below checks that
the page lists the same edges.

Each failure names the file, the line and the import, and what the table says.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"

# Folder -> the other folders its modules may import (docs/architecture.md, "The direction table").
_LIBRARY: dict[str, frozenset[str]] = {
    "proto": frozenset(),
    "auth": frozenset({"proto"}),
    "wire": frozenset(),
    "native": frozenset(),
    "tinymodel": frozenset(),
    "engine": frozenset({"native"}),
    "kvtransfer": frozenset({"proto", "auth", "wire", "native"}),
    "prefill_worker": frozenset({"engine", "kvtransfer", "proto", "auth", "wire"}),
    "decode_worker": frozenset({"engine", "kvtransfer", "proto", "auth", "wire"}),
    "worker": frozenset({"prefill_worker", "decode_worker", "engine", "kvtransfer", "proto", "auth", "wire"}),
    "router": frozenset({"engine", "proto", "auth", "wire", "native"}),
    "controlplane": frozenset({"worker", "prefill_worker", "decode_worker", "proto", "auth", "wire"}),
    "operators": frozenset({"proto", "auth"}),
    "sim": frozenset({"router", "engine", "operators"}),
    "loadtest": frozenset({"proto"}),
    "deploy": frozenset(),
}
ALLOWED: dict[str, frozenset[str]] = {
    **_LIBRARY,
    "bench": frozenset(_LIBRARY),
    "cli": frozenset({*_LIBRARY, "bench"}),
    "tests": frozenset({*_LIBRARY, "bench", "cli"}),
}

# The engine modules the router may import: each a leaf (below).
ROUTER_ENGINE = frozenset(
    {
        "engine.block_hash",
        "engine.tokenizer",
        "engine.detokenizer",
        "engine.structured.spec",
        "engine.structured.compiler",
    }
)
# The engine's leaves import nothing of Tandem but each other and LEAF_PACKAGES; engine.kernels is the C block
# hasher that engine.block_hash loads, engine.structured.native llguidance's C API that the compiler's matchers use.
ENGINE_LEAVES = ROUTER_ENGINE | {"engine.kernels", "engine.structured.native"}
LEAF_PACKAGES = frozenset({"native"})
# The simulator reuses the engine's scheduler side, nothing that runs a forward pass, and the planner.
SIM_ENGINE = frozenset(
    {
        "engine.scheduler",
        "engine.block_pool",
        "engine.kv_cache_manager",
        "engine.config",
        "engine.model_config",
        "engine.request",
        "engine.sampling_params",
        "engine.block_hash",
    }
)
SIM_OPERATORS = frozenset({"operators.planner"})
# (importer folder, imported folder) -> the modules (and their submodules) that edge may reach.
RESTRICTED: dict[tuple[str, str], frozenset[str]] = {
    ("router", "engine"): ROUTER_ENGINE,
    ("sim", "engine"): SIM_ENGINE,
    ("sim", "operators"): SIM_OPERATORS,
}
# DESIGN.md's "must not" column, where a third-party import shows it.
FORBIDDEN_EXTERNAL: dict[str, frozenset[str]] = {
    "engine": frozenset({"grpc", "ray", "kopf", "kubernetes", "kubernetes_asyncio"}),
    "router": frozenset({"torch", "ray", "kopf"}),
    "operators": frozenset({"torch", "ray"}),
    "controlplane": frozenset({"kopf", "kubernetes", "kubernetes_asyncio"}),
}

_SKIP_DIRS = frozenset({"build", "dist", "docs", "models", "node_modules", "__pycache__"})  # and hidden folders


@dataclass(slots=True, frozen=True)
class Import:
    """One import statement's edge: ``importer`` (a module) reaches ``target`` (a Tandem module, or the top-level
    name of a third-party package when ``external``)."""

    importer: str
    target: str
    path: Path
    line: int
    text: str
    external: bool

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}: {self.text}"


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_files(root: Path) -> list[Path]:
    files = []
    for top in sorted(root.iterdir()):
        if not top.is_dir() or top.name.startswith(".") or top.name.endswith(".egg-info") or top.name in _SKIP_DIRS:
            continue
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(root).parts
            if not any(part.startswith(".") or part in _SKIP_DIRS for part in rel):
                files.append(path)
    return files


def _literal_import_module(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name != "import_module" or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


class _Resolver:
    """Maps an imported name to the Tandem module that importing it loads (the longest prefix that is a module)."""

    def __init__(self, root: Path, modules: dict[str, Path]) -> None:
        self.root = root
        self.modules = modules

    def resolve(self, name: str, path: Path) -> str | None:
        # A script folder (no __init__.py: tests/, loadtest/) is on sys.path itself: siblings by bare name first.
        candidates = [(name.split("."), 1)]
        if not (path.parent / "__init__.py").exists():
            folder = _module_name(self.root, path.parent / "__init__.py").split(".")
            candidates.insert(0, ([*folder, *name.split(".")], len(folder) + 1))
        for parts, shortest in candidates:
            for end in range(len(parts), shortest - 1, -1):
                if ".".join(parts[:end]) in self.modules:
                    return ".".join(parts[:end])
        return None

    def targets(self, node: ast.AST, importer: str, path: Path) -> list[str]:
        """The names ``node`` imports, resolved where they are Tandem's; a third party's as its top-level name."""
        if isinstance(node, ast.Import):
            return [self._target(alias.name, path) for alias in node.names]
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([module] if module else [])])
            found = []
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.append(submodule if submodule in self.modules else self._target(module, path))
            return found
        if isinstance(node, ast.Call) and (name := _literal_import_module(node)) is not None:
            return [self._target(name, path)]
        return []

    def _target(self, name: str, path: Path) -> str:
        return self.resolve(name, path) or name.split(".")[0]


def import_graph(root: Path) -> list[Import]:
    """Every import in every ``.py`` file under ``root``'s folders, each with the module it loads."""
    modules = {_module_name(root, path): path for path in _source_files(root)}
    resolver = _Resolver(root, modules)
    edges = []
    for importer, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            for target in resolver.targets(node, importer, path):
                line = getattr(node, "lineno", 0)
                text = lines[line - 1].strip()
                edges.append(Import(importer, target, path, line, text, target not in modules))
    return edges


@functools.cache
def _repo_graph() -> tuple[Import, ...]:
    return tuple(import_graph(REPO))


def _folder(module: str) -> str:
    return module.split(".")[0]


def _within(module: str, prefixes: frozenset[str]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def _internal() -> list[Import]:
    return [edge for edge in _repo_graph() if not edge.external and edge.target != edge.importer]


def _report(title: str, problems: list[str]) -> str:
    return f"{title} ({len(problems)}):\n  " + "\n  ".join(sorted(set(problems), key=problems.index))


def test_every_folder_with_python_is_placed_in_the_table() -> None:
    folders = {_folder(edge.importer) for edge in _repo_graph()} | {
        path.relative_to(REPO).parts[0] for path in _source_files(REPO)
    }
    assert folders == set(ALLOWED), (
        f"folders missing from the table: {sorted(folders - set(ALLOWED))}; "
        f"rows for folders that are gone: {sorted(set(ALLOWED) - folders)}"
    )


def test_the_table_points_one_way() -> None:
    table = nx.DiGraph([(src, dst) for src, dsts in ALLOWED.items() for dst in dsts])
    assert nx.is_directed_acyclic_graph(table), f"the table has a cycle: {nx.find_cycle(table)}"
    assert set(table.predecessors("cli")) == {"tests"}, "nothing but the tests imports the composition root"
    assert set(table.predecessors("bench")) == {"cli", "tests"}, "the library never imports bench"


def test_imports_between_folders_follow_the_direction_table() -> None:
    problems = []
    for edge in _internal():
        src, dst = _folder(edge.importer), _folder(edge.target)
        if src == dst:
            continue
        if dst not in ALLOWED[src]:
            problems.append(f"{edge.where(REPO)}  [{src} may not import {dst}]")
        elif (src, dst) in RESTRICTED and not _within(edge.target, RESTRICTED[src, dst]):
            allowed = ", ".join(sorted(RESTRICTED[src, dst]))
            problems.append(f"{edge.where(REPO)}  [{src} may import only {allowed} of {dst}, not {edge.target}]")
    assert not problems, _report("imports that the direction table rules out", problems)


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts))}


def test_engine_leaf_modules_import_nothing_else_of_tandem() -> None:
    # Importing a leaf runs its packages' __init__.py first, so those are held to the same rule.
    packages = set().union(*(_ancestors(leaf) for leaf in ENGINE_LEAVES))
    held = {edge.importer for edge in _repo_graph()}
    checked = {module for module in held if _within(module, ENGINE_LEAVES) or module in packages}
    assert held >= ENGINE_LEAVES, f"leaf modules not found: {sorted(ENGINE_LEAVES - held)}"
    problems = [
        f"{edge.where(REPO)}  [{edge.importer} is an engine leaf; {edge.target} is not a leaf]"
        for edge in _internal()
        if edge.importer in checked
        and not (_within(edge.target, ENGINE_LEAVES) or edge.target in packages or _within(edge.target, LEAF_PACKAGES))
    ]
    assert not problems, _report("engine leaf modules importing the rest of Tandem", problems)


def _cycles(witnesses: dict[tuple[str, str], list[Import]], limit: int = 20) -> list[str]:
    """Each elementary cycle of the graph whose edges are ``witnesses``' keys, every hop with the import lines that
    make it (at most ``limit`` cycles, shortest first)."""
    graph = nx.DiGraph(list(witnesses))
    found = sorted(itertools.islice(nx.simple_cycles(graph), limit + 1), key=lambda cycle: (len(cycle), cycle))
    report = []
    for cycle in found[:limit]:
        hops = []
        for src, dst in zip(cycle, [*cycle[1:], cycle[0]], strict=True):
            lines = list(dict.fromkeys(edge.where(REPO) for edge in witnesses[src, dst]))
            more = f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""
            hops.append(f"{src} -> {dst}: " + "; ".join(lines[:3]) + more)
        report.append(" -> ".join([*cycle, cycle[0]]) + "\n      " + "\n      ".join(hops))
    if len(found) > limit:
        report.append(f"... and more cycles past these {limit}")
    return report


def test_no_import_cycle_between_folders() -> None:
    witnesses: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for edge in _internal():
        src, dst = _folder(edge.importer), _folder(edge.target)
        if src != dst:
            witnesses[src, dst].append(edge)
    problems = _cycles(witnesses)
    assert not problems, _report("import cycles between folders", problems)


def test_no_import_cycle_between_modules() -> None:
    witnesses: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for edge in _internal():
        witnesses[edge.importer, edge.target].append(edge)
    problems = _cycles(witnesses)
    assert not problems, _report("import cycles between modules", problems)


def test_third_party_imports_that_design_rules_out() -> None:
    problems = [
        f"{edge.where(REPO)}  [{_folder(edge.importer)} must not import {edge.target}]"
        for edge in _repo_graph()
        if edge.external and edge.target in FORBIDDEN_EXTERNAL.get(_folder(edge.importer), frozenset())
    ]
    assert not problems, _report("third-party imports that DESIGN.md rules out", problems)


def _doc_table() -> dict[str, frozenset[str]]:
    """The "may import" column of docs/architecture.md's direction table, as sets of folders."""
    section = DOC.read_text().split("## The direction table", 1)[1].split("\n## ", 1)[0]
    cells: dict[str, str] = {}
    for line in section.splitlines():
        row = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(row) == 3 and (match := re.fullmatch(r"`(\w+)/`", row[0])):
            cells[match.group(1)] = row[2]
    rows: dict[str, frozenset[str]] = {}
    for folder, may_import in cells.items():
        named = frozenset(re.findall(r"`(\w+)`", may_import))
        if may_import == "nothing":
            rows[folder] = frozenset()
        elif may_import.startswith("everything"):  # "everything" or "everything but `x` and `y`"
            rows[folder] = frozenset(set(cells) - named - {folder})
        else:
            rows[folder] = named
    return rows


def test_the_architecture_page_shows_this_table() -> None:
    assert _doc_table() == ALLOWED
    text = DOC.read_text()
    missing = sorted(name for name in ENGINE_LEAVES | SIM_ENGINE | SIM_OPERATORS if f"`{name}`" not in text)
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_the_graph_sees_imports_in_functions_under_type_checking_relative_and_by_literal_name(tmp_path: Path) -> None:
    (tmp_path / "alpha").mkdir()
    (tmp_path / "alpha" / "__init__.py").write_text("")
    (tmp_path / "alpha" / "low.py").write_text("import json\n")
    (tmp_path / "alpha" / "high.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import low\n"
        "if TYPE_CHECKING:\n"
        "    from beta.thing import Thing\n"
        "def run() -> None:\n"
        "    import beta\n"
        "    importlib.import_module('beta.thing')\n"
    )
    (tmp_path / "beta").mkdir()
    (tmp_path / "beta" / "__init__.py").write_text("")
    (tmp_path / "beta" / "thing.py").write_text("from alpha import low\nfrom alpha.low import nothing_here\n")
    (tmp_path / "alpha" / "tools").mkdir()
    (tmp_path / "alpha" / "tools" / "run.py").write_text("import torch\nimport low\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "main.py").write_text("from helper import x\nimport alpha.high\n")
    (tmp_path / "scripts" / "helper.py").write_text("x = 1\n")
    found = {(edge.importer, edge.target, edge.line, edge.external) for edge in import_graph(tmp_path)}
    assert found == {
        ("alpha.low", "json", 1, True),
        ("alpha.high", "typing", 1, True),
        ("alpha.high", "alpha.low", 2, False),
        ("alpha.high", "beta.thing", 4, False),
        ("alpha.high", "beta", 6, False),
        ("alpha.high", "beta.thing", 7, False),
        ("beta.thing", "alpha.low", 1, False),
        ("beta.thing", "alpha.low", 2, False),
        ("scripts.main", "scripts.helper", 1, False),
        ("scripts.main", "alpha.high", 2, False),
        ("alpha.tools.run", "torch", 1, True),
        ("alpha.tools.run", "low", 2, True),
    }
