"""The shape of ``stable_attn/monitor``: three folders and a small top level, no import cycle, imports from the
defining module (never a name re-exported by a package ``__init__``), and an engine that runs the step protocol
without owning the actions' or the alerts' state."""

from __future__ import annotations

import ast
import os

import stable_attn.monitor as monitor

ROOT = os.path.dirname(monitor.__file__)
FOLDERS = {"detectors", "actions", "alerts"}


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith("__init__") else rel] = path
    return out


def _imports(module: str, path: str, known: dict[str, str]) -> set[str]:
    """The modules of ``monitor`` that ``module`` imports (statements under ``if TYPE_CHECKING`` aside)."""
    tree = ast.parse(open(path).read())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
        node.test) for n in ast.walk(node)}
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and id(node) not in typing_only:
            base = [p for p in package[: len(package) - (node.level - 1)] if p]
            if node.level - 1 > len(package):
                continue  # outside monitor
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}".strip(".")
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != module}


def test_the_top_level_is_small_and_the_folders_are_there():
    entries = os.listdir(ROOT)
    files = [e for e in entries if e.endswith(".py")]
    assert FOLDERS <= {e for e in entries if os.path.isdir(os.path.join(ROOT, e))}
    assert len(files) <= 10, sorted(files)


def test_no_import_cycle_and_no_name_taken_from_a_package_init():
    known = _modules()
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    for module, targets in graph.items():
        inits = {t for t in targets if t in {"", *FOLDERS} and not module.startswith(f"{t}.") and module != t}
        assert not inits or module == "" or (module in FOLDERS), (module, inits)  # a re-export, not the source
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in graph[module]:
            if module.startswith(f"{target}.") or (target == "" and module):
                continue  # a parent package runs first anyway
            assert state.get(target) != 1, " -> ".join(trail + [module, target])
            if target not in state:
                visit(target, trail + [module])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [])


def test_the_engine_is_small_and_sets_no_attribute_by_a_loop():
    path = os.path.join(ROOT, "engine.py")
    source = open(path).read()
    (engine,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "MonitorEngine"]
    methods = [n for n in engine.body if isinstance(n, ast.FunctionDef)]
    assert len(source.splitlines()) <= 590 and len(methods) <= 27
    loops = [n for n in ast.walk(engine) if isinstance(n, ast.For | ast.comprehension)
             and any(isinstance(c, ast.Call) and getattr(c.func, "id", None) == "setattr" for c in ast.walk(n))]
    assert not loops
