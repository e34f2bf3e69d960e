"""The package's shape: the import arrows drawn in docs/architecture.md, a light
`import graddbg`, the public API."""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

import graddbg

PKG = pathlib.Path(graddbg.__file__).parent

ARCHITECTURE = pathlib.Path(__file__).parent.parent / "docs" / "architecture.md"

# module -> graddbg modules it may import at module level (docs/architecture.md's arrows)
ALLOWED = {
    "_errors": set(),
    "_args": {"_errors"},
    "_source": set(),
    "_io": {"_errors"},
    "_compiled": set(),
    "__init__": {"_errors", "gradcheck"},
    "__main__": {"cli"},
    "_model": {"_errors"},
    # graddbg's distributed internals (graddbg/_dist/), above _errors and _model, under everything
    # that exchanges with other ranks (stats, checks, hooks, ddp_verify), which none of them imports
    "_hookset": set(),  # HookSet, under hooks and _dist, which both register hooks through it
    "_dist": set(),
    "_dist.store": set(),  # the store, the one check-in (RollCall) and the one poll
    "_dist.collective": {"_dist.store"},
    "_dist.peers": {"_dist.store"},
    "_dist.groups": {"_errors", "_model", "_dist.collective"},  # which ranks hold what, found once
    "_dist.arrival": {"_errors", "_dist.peers", "_dist.store"},  # a watch: check-in and meeting at boundaries
    "_dist.stages": {"_model", "_hookset", "_dist.collective", "_dist.groups"},  # pipeline stages, the summary
    "_dist.layout": {"_dist.arrival", "_dist.groups", "_dist.stages"},  # a watch's facade over the three
    "_dist.rendezvous": {"_errors", "_dist.collective", "_dist.groups", "_dist.store"},  # ddp_verify's header
    "_dist.replicas": {"_errors", "_args", "_model", "_dist.collective", "_dist.groups"},  # ddp_verify's replica sets
    "_deepspeed": {"_errors", "_model", "_dist.collective", "stats"},
    "stats": {"_errors", "_model", "_dist.collective"},
    "anomaly": {"_errors", "_args", "_source"},
    "blame": {"_errors", "_source", "_model", "anomaly"},
    "options": {"_errors", "_args", "stats", "anomaly", "trackers"},
    # log_to's adapters (wandb, mlflow and tensorboard imported inside functions)
    "trackers": {"_errors", "_args", "_model", "stats"},
    "checks": {"_errors", "_args", "_source", "_model", "_dist.collective", "_dist.layout", "stats", "anomaly", "blame",
               "checks"},
    "hooks": {"_errors", "_args", "_source", "_model", "_deepspeed", "_dist.layout", "_hookset", "stats", "anomaly", "blame", "options",
              "checks", "trackers"},
    "callbacks": {"_errors", "_io", "_model", "hooks", "options", "trackers"},
    "gradcheck": {"_errors", "_args", "_source", "_model"},
    "pytest_plugin": {"_errors", "gradcheck"},
    "graphviz": {"_errors", "_source", "_model", "_io"},
    "plots": {"_errors"},
    # ddp_verify (the public API) over its parts: hashing, the rendezvous, replica groups, the verdict
    "_fingerprint": {"_errors", "_compiled"},
    "_verdict": {"_errors", "_fingerprint", "_dist.collective", "_dist.rendezvous", "_dist.replicas"},
    "ddp_verify": {"_errors", "_args", "_model", "_fingerprint", "_dist.rendezvous", "_dist.replicas", "_verdict"},
    "run": {"_errors", "_model", "stats", "anomaly", "_io"},
    "report": {"_errors", "_source", "_model", "_io", "stats", "anomaly", "plots", "graphviz"},
    "_demo_model": set(),  # the demo's model and loop: user-level code (graddbg demo)
    "_script": set(),  # script discovery for graddbg run (cli's engine)
    "cli": None,  # on top of everything
    "_launch": set(),
}
# imports inside functions may also reach these (lazily, to keep imports light)
LAZY = {
    "__init__": None,
    "_model": {"_errors"},
    "hooks": {"run", "stats", "plots", "report"},
    "checks": {"ddp_verify"},
    "run": {"plots", "report", "stats", "anomaly", "graphviz", "__init__"},
    "report": {"plots", "graphviz", "stats", "anomaly", "__init__"},
    "pytest_plugin": {"gradcheck", "stats", "hooks", "anomaly"},
    "plots": {"stats"},  # (rollup_norms: the one roll-up rule)
    "_demo_model": {"__init__"},  # (graddbg.watch, as a user's script calls it)
    "_script": {"_model", "__init__", "run"},
}


#: subpackages whose modules are layers of their own, named "_dist.peers" (checks/ is one unit)
SPLIT = ("_dist",)


def _layer(dotted: str) -> str:
    """The layout's name of the graddbg module ``dotted`` (``graddbg.stats``: "stats";
    ``graddbg._dist.peers``: "_dist.peers"; ``graddbg.checks.base``: "checks")."""
    parts = dotted.split(".")[1:]
    return ".".join(parts[:2]) if parts[0] in SPLIT and len(parts) > 1 else parts[0]


def _graddbg_imports(node: ast.AST) -> set:
    names = set()
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name.startswith("graddbg."):
                names.add(_layer(a.name))
            elif a.name == "graddbg":
                names.add("__init__")
    elif isinstance(node, ast.ImportFrom) and node.module:
        if node.level == 0 and node.module in tuple(f"graddbg.{s}" for s in SPLIT):
            here = PKG / node.module.split(".")[1]
            names.update(_layer(f"{node.module}.{a.name}") if (here / f"{a.name}.py").exists()
                         else _layer(node.module) for a in node.names)
        elif node.level == 0 and node.module.startswith("graddbg."):
            names.add(_layer(node.module))
        elif node.level == 0 and node.module == "graddbg":
            subs = {p.stem for p in PKG.glob("*.py")} | {p.parent.name for p in PKG.glob("*/__init__.py")}
            names.update(a.name if a.name in subs else "__init__" for a in node.names)
        elif node.level == 1:
            names.add(node.module.split(".")[0])
    return names


def _split_imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    top, nested = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            top |= _graddbg_imports(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        else:
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    nested |= _graddbg_imports(sub)
    return top, nested


MODULES = sorted(p.stem for p in PKG.glob("*.py")) + ["checks"] + sorted(
    f"{s}.{p.stem}" if p.stem != "__init__" else s for s in SPLIT for p in (PKG / s).glob("*.py"))


def _files(module: str):
    """The files of a module (a package: every file in it; a subpackage in SPLIT: its
    ``__init__.py``, its modules being layers of their own)."""
    if module in SPLIT:
        return [PKG / module / "__init__.py"]
    if "." in module:
        return [PKG / (module.replace(".", "/") + ".py")]
    return sorted((PKG / module).glob("*.py")) if (PKG / module).is_dir() else [PKG / f"{module}.py"]


def test_the_architecture_page_names_every_module():
    text = ARCHITECTURE.read_text()
    missing = [m for m in MODULES if m not in ("__init__", "__main__") and m not in text]
    assert not missing, missing


def test_every_module_is_known_to_the_layout_test():
    assert set(MODULES) <= set(ALLOWED), set(MODULES) - set(ALLOWED)


@pytest.mark.parametrize("module", MODULES)
def test_imports_point_down(module):
    top, nested = set(), set()
    for path in _files(module):
        t, n = _split_imports(path)
        top, nested = top | t, nested | n
    top.discard(module)
    nested.discard(module)
    allowed = ALLOWED[module]
    if allowed is None:
        return
    assert top <= allowed, f"graddbg.{module} imports {sorted(top - allowed)} at module level"
    lazy = LAZY.get(module, set())
    if lazy is None:
        return
    bad = nested - allowed - lazy
    assert not bad, f"graddbg.{module} imports {sorted(bad)} inside functions"


def test_the_distributed_internals_sit_under_everything_that_uses_them():
    """graddbg/_dist/ imports only the bottom (_errors, _args, _model, _hookset) and itself,
    at any depth: never stats, checks, hooks or ddp_verify, which use it."""
    below = {"_errors", "_args", "_model", "_hookset"}
    for module in (m for m in MODULES if m.split(".")[0] in SPLIT):
        top, nested = _split_imports(_files(module)[0])
        outside = {m for m in top | nested if m.split(".")[0] not in SPLIT} - below
        assert not outside, f"graddbg.{module} imports {sorted(outside)}"


def _graph():
    """module -> graddbg modules it imports (at module level or inside functions)."""
    out = {}
    for module in MODULES:
        deps = set()
        for path in _files(module):
            top, nested = _split_imports(path)
            deps |= top | nested
        out[module] = deps - {module, "__init__"}
    return out


def test_no_import_circles():
    graph, state, cycle = _graph(), {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                cycle.append(path + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycle, cycle


def test_no_private_names_imported_across_modules():
    """What one module needs of another is public in it (``_model``, ``_io``, ``_compiled``,
    ``_collective`` and ``_errors`` are private modules with public names)."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graddbg"):
                bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def test_import_graddbg_loads_nothing_heavier_than_torch():
    code = (
        "import sys, torch; base = set(sys.modules); import graddbg, graddbg.stats, graddbg.hooks, "
        "graddbg.anomaly, graddbg.gradcheck, graddbg.graphviz, graddbg.ddp_verify, graddbg.run; "
        "new = set(sys.modules) - base; "
        "print(sorted(m for m in ('pandas', 'matplotlib', 'graphviz', 'torchviz', 'pyarrow', 'scipy') if m in new))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_public_api_names_resolve():
    for name in graddbg.__all__:
        assert getattr(graddbg, name) is not None, name
    for name in ("watch", "Watch", "load", "Anomaly", "NonFinite", "Explode", "Vanish", "find_nonfinite",
                 "gradcheck", "check_module", "assert_gradients_close", "GradcheckResult", "graph", "Graph",
                 "GraddbgError", "GradientAnomalyError", "NonFiniteError", "GradientMismatchError",
                 "DDPInconsistencyError", "GraddbgWarning", "PrecisionWarning"):
        assert name in graddbg.__all__, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        graddbg.nope


def test_anomaly_does_not_import_blame():
    top, nested = _split_imports(PKG / "anomaly.py")
    assert "blame" not in top | nested


def test_no_function_longer_than_about_60_lines():
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) and \
                    isinstance(getattr(node.body[0], "value", None), ast.Constant) else None
                if doc is not None:  # the docstring is text, not code
                    n -= doc.end_lineno - doc.lineno + 1
                if n > 65:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_error_family():
    assert issubclass(graddbg.GraddbgError, RuntimeError)
    assert issubclass(graddbg.NonFiniteError, graddbg.GradientAnomalyError)
    assert issubclass(graddbg.GradientAnomalyError, graddbg.GraddbgError)
    assert issubclass(graddbg.GradientMismatchError, AssertionError)
    assert issubclass(graddbg.GradientMismatchError, graddbg.GraddbgError)
    assert issubclass(graddbg.PrecisionWarning, graddbg.GraddbgWarning)
    assert (PKG / "py.typed").exists()


# --------------------------------------------------------------------------- private reach-ins
#: private names that are public protocols of other libraries (IPython's display hooks)
PROTOCOL = re.compile(r"^_(repr_\w+|ipython_\w+)_$")


def _class_privates(cls: ast.ClassDef) -> set:
    """The private names a class defines: its methods, ``self._x``/``cls._x`` assignments in
    them, and assignments in its body."""
    found = set()
    for n in ast.walk(cls):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
                isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
            found.add(n.attr)
    for n in cls.body:
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []):
            if isinstance(t, ast.Name):
                found.add(t.id)
    return {a for a in found if a.startswith("_") and not a.startswith("__")}


def _module_privates(tree: ast.Module) -> set:
    found = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(n.name)
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []):
            found.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
    return {a for a in found if a.startswith("_") and not a.startswith("__")}


def private_reach_ins(paths, root: pathlib.Path) -> list:
    """``x._name`` where ``_name`` is a private name that graddbg (or a bench) defines, read
    on something else than ``self``/``cls`` outside the class that defines it: another
    object's private attribute, or another module's private function (``module._f``)."""
    trees = {p: ast.parse(p.read_text()) for p in paths}
    known = set()
    for tree in trees.values():
        known |= _module_privates(tree)
        known.update(*(_class_privates(c) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)))
    found = []

    def visit(node, path, own):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, path, _class_privates(child))
                continue
            if isinstance(child, ast.Attribute) and child.attr in known and child.attr not in own \
                    and not PROTOCOL.match(child.attr) \
                    and not (isinstance(child.value, ast.Name) and child.value.id in ("self", "cls")):
                found.append(f"{path.relative_to(root)}:{child.lineno} {ast.unparse(child)}")
            visit(child, path, own)

    for path, tree in trees.items():
        visit(tree, path, set())
    return found


def test_no_private_reach_ins():
    """What one object or module needs of another goes through its public names: no
    ``scan._push`` from a function outside the scan's class, no ``ctx._reader._shards`` from a
    bench (an object may read its own class's private fields on another instance)."""
    paths = sorted(PKG.rglob("*.py")) + sorted((PKG.parent / "bench").glob("*.py"))
    assert private_reach_ins(paths, PKG.parent) == []


def test_the_reach_in_check_sees_a_reach_in(tmp_path):
    (tmp_path / "a.py").write_text(
        "class Scan:\n    def __init__(self):\n        self._stack = []\n\n"
        "    def push(self, other):\n        other._stack.append(1)   # its own class: allowed\n\n\n"
        "def use(scan):\n    scan._stack.clear()\n    return scan._repr_svg_()\n")
    (tmp_path / "b.py").write_text("import a\n\n\ndef f(x):\n    return a._helper(x), x._stack, x._version\n")
    (tmp_path / "c.py").write_text("def _helper(x):\n    return x\n")
    found = private_reach_ins(sorted(tmp_path.glob("*.py")), tmp_path)
    # (x._version: a private name graddbg does not define, such as torch's, is not checked here)
    assert [f.split(" ", 1)[1] for f in found] == ["scan._stack", "a._helper", "x._stack"]


# --------------------------------------------------------------------------- module sizes
@pytest.mark.parametrize("module", ["ddp_verify", "_fingerprint", "_dist.rendezvous", "_dist.replicas", "_verdict"])
def test_ddp_verify_and_its_parts_stay_under_about_800_lines(module):
    assert len(_files(module)[0].read_text().splitlines()) <= 820


# checks/ module -> the checks/ modules it may import: the shared base at the bottom, then the
# step's named parts (the ledger keeper, the recorder), then what reads the recorder, then the
# checks; a check imports another only to name it in ``after`` (what it reads after)
CHECKS_ALLOWED = {
    "budget": set(),
    "base": {"budget"},
    "copies": {"base"},
    "ledger": {"base"},
    "graph": {"base", "ledger"},
    "recorder": {"base", "ledger", "graph"},  # (graph: the loss handed to backward, for w.steps)
    "histograms": {"base", "recorder"},
    "activations": {"base", "recorder"},
    "stages": {"base", "recorder"},
    "zero": {"base", "recorder"},
    "update": {"base", "budget", "recorder"},
    "hygiene": {"base", "ledger", "graph", "recorder"},  # (graph: what a step without gradients went through)
    "applied": {"base", "ledger", "recorder"},  # (and graddbg._args: the audit's cadence)
    "detectors": {"base", "ledger", "recorder", "stages", "activations"},
    "replicas": {"base", "recorder", "stages"},
    "audit": {"base", "budget", "ledger", "recorder"},
    "gradaudit": {"base", "budget", "ledger", "recorder"},
    "manual": {"base", "budget", "ledger"},
    "construction": {"base", "ledger"},
    "__init__": None,  # (gathers them all)
}


def test_the_arrows_between_checks_follow_the_steps_parts():
    found = {}
    for path in sorted((PKG / "checks").glob("*.py")):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("graddbg.checks."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.ImportFrom) and node.module == "graddbg.checks":
                deps.add("__init__")
            elif isinstance(node, ast.ImportFrom) and node.level >= 1:
                deps.add((node.module or "__init__").split(".")[0])
        found[path.stem] = deps
    assert set(found) == set(CHECKS_ALLOWED), "a checks/ module without its arrows here (or one gone)"
    for module, deps in found.items():
        allowed = CHECKS_ALLOWED[module]
        assert allowed is None or deps <= allowed, f"graddbg.checks.{module} imports {sorted(deps - allowed)}"
