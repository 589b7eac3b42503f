"""The package's layers point one way: every import inside gemma4opt (module level or inside a
function) goes from a higher layer to a lower one or stays inside its package, and no modules
import each other in a cycle. Read from the source (AST), so lazy imports count too."""
import ast
import collections
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lowest first. A package may import its own modules and any lower layer's, never a higher one.
LAYERS = [
    {"progress", "fixed_tensors", "step_inputs", "presets", "loading", "edits", "tensor_parallel"},
    {"copying"},
    {"kernels"},
    {"ops"},
    {"compiler"},
    {"patterns"},
    {"paged"},
    {"runtime"},
    {"config"},
    {"api"},
    {"warmup", "report", "explain"},
    {"__init__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _modules() -> dict[str, str]:
    """module name -> source path, for gemma4opt and patterns/ (installed as gemma4opt.patterns)."""
    out = {}
    for base, package in (("gemma4opt", "gemma4opt"), ("patterns", "gemma4opt.patterns")):
        top = os.path.join(ROOT, base)
        for dirpath, _, files in os.walk(top):
            if os.path.islink(dirpath) or "__pycache__" in dirpath:
                continue
            rel = os.path.relpath(dirpath, top)
            if base == "gemma4opt" and rel.split(os.sep)[0] == "patterns":
                continue            # a developer's symlink to ../patterns
            for f in files:
                if f.endswith(".py"):
                    parts = [package] + ([] if rel == "." else rel.split(os.sep))
                    if f != "__init__.py":
                        parts.append(f[:-3])
                    out[".".join(parts)] = os.path.join(dirpath, f)
    return out


def _imports(path: str, modules) -> set[str]:
    """The gemma4opt modules a file imports (``from a import b`` counts a.b when that is a module)."""
    got = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gemma4opt"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                got.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            got.update(a.name for a in node.names if a.name.startswith("gemma4opt"))
    return {m for m in got if m in modules}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph():
    modules = _modules()
    return {m: _imports(p, modules) for m, p in modules.items()}


def _upward(graph) -> list[tuple[str, str]]:
    return [(a, b) for a, deps in graph.items() for b in deps
            if _package(a) != _package(b) and RANK[_package(b)] >= RANK[_package(a)]]


def _cycles(graph) -> list[list[str]]:
    state, stack, cycles = collections.defaultdict(int), [], []

    def visit(m):                       # depth-first; a node met again while on the stack closes a cycle
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state[d] == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif state[d] == 0:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m)
    return cycles


def test_every_package_has_a_layer():
    assert {_package(m) for m in _graph()} <= set(RANK), {_package(m) for m in _graph()} - set(RANK)


def test_no_import_reaches_up_a_layer():
    assert not _upward(_graph())


def test_no_import_cycle():
    assert not _cycles(_graph())


def test_the_checks_see_an_upward_edge_and_a_cycle():
    graph = _graph()
    graph["gemma4opt.paged.step"].add("gemma4opt.api")
    assert _upward(graph) == [("gemma4opt.paged.step", "gemma4opt.api")]
    graph["gemma4opt.ops.pick"].add("gemma4opt.ops.linear")      # linear imports pick
    assert _cycles(graph)
