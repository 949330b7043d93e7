"""The first-party packages import each other without circles: every ``import`` in rlhf_core, tasks and flows, at
any level (module, class or function body), resolved to the modules of these packages (with the packages'
``__init__`` an import runs first), forms an acyclic graph. A circle through function-level imports works at run
time but still ties the modules into one; here it fails and names the modules."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rlhf_core", "tasks", "flows", "benchmarks")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is named by its __init__.py)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The first-party modules that ``name`` imports anywhere in its source, with the packages that run first."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: anchored at this module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import sub` imports the submodule; `from mod import name` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` of a first-party module; the longest first-party prefix otherwise
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # importing a.b.c runs a/__init__ and a/b/__init__ first: those of them that are not this module's own
            # packages (already running when it runs) are imported too
            while target and not (name == target or name.startswith(target + ".")):
                found.add(target)
                target = target.rpartition(".")[0]
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of two or more modules that each reach every other one (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # a few hundred modules: recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def shortest_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest closed path ``a -> ... -> a`` through the group's first module (breadth-first)."""
    start = min(group)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per group of modules that import each other: a cycle through it, and the whole group."""
    return [" -> ".join(shortest_cycle(graph, g)) + f"   (the group: {', '.join(sorted(g))})"
            for g in strongly_connected(graph)]


def test_find_cycles_reports_each_circle_and_its_group():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"b"}, "e": {"f"}, "f": set()}
    assert find_cycles(graph) == ["a -> b -> c -> a   (the group: a, b, c, d)"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_resolution_covers_function_level_imports_and_packages():
    graph = import_graph()
    assert {"rlhf_core", "tasks.stages", "flows.cli", "rlhf_core.config"} <= graph.keys()
    assert "flows.pipeline" in graph["flows.cli"]  # imported inside a command function only
    # `from rlhf_core.engine import distributed` imports the submodule after the package's __init__
    assert {"rlhf_core.engine", "rlhf_core.engine.distributed"} <= graph["rlhf_core.trainers.rlhf.trainer"]
    # a module's own packages are already running when it runs: no edge back to them
    assert "rlhf_core.engine" not in graph["rlhf_core.engine.loop"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


MAX_MODULE_LINES = 400


def test_no_module_is_over_400_lines():
    """Short files (issue #30): a module that outgrows this is split by what it does."""
    lines = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    long = {name: n for name, n in lines.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def _third_party_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_layers_point_down():
    """rlhf_core (the library) imports nothing of tasks, flows or benchmarks, nor Prefect, at any level; tasks
    imports neither flows nor benchmarks."""
    graph, modules = import_graph(), _modules()
    above = {"rlhf_core": ("tasks", "flows", "benchmarks"), "tasks": ("flows", "benchmarks")}
    wrong = [f"{name} -> {target}" for name, targets in graph.items() for target in sorted(targets)
             if target.split(".")[0] in above.get(name.split(".")[0], ())]
    wrong += [f"{name} -> prefect" for name, path in modules.items()
              if name.startswith("rlhf_core") and "prefect" in _third_party_roots(path)]
    assert not wrong, "imports that point up a layer:\n" + "\n".join(wrong)


# Where an import may stay inside a function, and why. First-party modules: only in the command lines, whose
# verbs import just their own code (flows.cli must also set Prefect's settings before Prefect is first imported:
# tests/test_install_split.py). Third-party: packages an extra provides (a stage image lacks the orchestration
# extra; peft, TRL and plotting are optional) or that only one path of a module needs.
LAZY_FIRST_PARTY = {"rlhf_core/cli.py", "flows/cli.py", "flows/cli_workspace.py"}
LAZY_THIRD_PARTY = {
    "prefect": "the orchestration extra", "prefect_kubernetes": "the k8s extra", "kubernetes": "the k8s extra",
    "mlflow": "the full server is the orchestration extra; tracking is optional (RLHF_TRACKING=off)",
    "dvc": "the orchestration extra", "peft": "LoRA only", "deepspeed": "imported after its accelerator is set",
    "matplotlib": "plots only", "transformers": "model paths only (prepare and the CLI do not load a model)",
    "pyarrow": "parquet paths only", "pandas": "tabular paths only", "datasets": "streamed sources only",
    "fsspec": "remote sources only", "huggingface_hub": "hub ids only", "safetensors": "checkpoint paths only",
    "tokenizers": "building a tokenizer only",
}


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import inside a function body of the file."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found += [(node.lineno, alias.name) for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    found.append((node.lineno, "." * node.level + (node.module or "")))
    return sorted(found)


def test_imports_are_at_module_level_unless_a_reason_is_listed():
    """The graph above has no circle, so no circle forces an import into a function (issue #30): at the top a reader
    sees what a module uses, and an import error shows when the module loads, not on the first call of one path."""
    wrong = []
    for path in _modules().values():
        rel = str(path.relative_to(REPO))
        if rel.startswith("benchmarks/"):
            continue
        for line, module in function_level_imports(path):
            root = module.split(".")[0]
            if root in LAZY_THIRD_PARTY or (rel in LAZY_FIRST_PARTY and root in PACKAGES):
                continue
            wrong.append(f"{rel}:{line}: {module}")
    assert not wrong, "imports inside functions without a listed reason:\n" + "\n".join(wrong)


def test_function_level_imports_are_found(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    import json\n    from . import sibling\n    from a.b import c\n")
    assert function_level_imports(src) == [(4, "json"), (5, "."), (6, "a.b")]
