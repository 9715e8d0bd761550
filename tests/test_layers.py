"""The package's layers (docs/dev/architecture.md): a module may import its own layer and the
layers below it, never one above, and no group of modules imports itself in a circle, within
a layer either (imports inside functions count too: hiding a cycle in a function does not
remove it). This keeps the ring in ``collectives/``, the negotiation in ``engine/`` and every
MPI call out of ``torch/``."""
import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "mpiddp"

# Lower index = lower layer (the table in docs/dev/architecture.md). Modules at the package root
# are listed by name; a subpackage by its name.
LAYERS = [
    {"reduce_ops", "errors", "config", "docstrings", "launcher_env", "horovod_env",
     "intel_mpi", "durable", "checkpoint_files"},
    {"buffers"},
    {"transport"},
    {"collectives"},
    {"engine"},
    {"gpu", "launch_check", "build_info", "run", "local_device"},
    {"runtime"},
    {"process_sets"},
    {"torch"},
    {"__init__", "elastic", "checkpoint", "checkpoint_sharded", "checkpoint_convert"},
]


def module_name(path: Path) -> tuple:
    """``mpiddp/a/b.py`` -> ('a', 'b'); a package's ``__init__.py`` -> its own name."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(parts: tuple) -> int:
    top = parts[0]
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"mpiddp.{'.'.join(parts)} is in no layer: add it to LAYERS and to "
                         "docs/dev/architecture.md")


def _resolved(target: tuple) -> tuple:
    """The longest prefix of ``target`` that is a module of the package (``from .a import
    f`` imports module ``a``; ``from . import b`` imports module ``b`` when it is one)."""
    while target and target not in MODULES:
        target = target[:-1]
    return target


def imported_modules(path: Path):
    """(line, mpiddp-relative module parts) for every import of a mpiddp module in ``path``."""
    relative = path.relative_to(PACKAGE).with_suffix("").parts
    package = relative[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            target = base + tuple(node.module.split(".")) if node.module else base
            for alias in node.names:
                module = _resolved(target + (alias.name,)) or ("__init__",)
                yield node.lineno, module
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpiddp."):
            yield node.lineno, _resolved(tuple(node.module.split(".")[1:]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mpiddp."):
                    yield node.lineno, _resolved(tuple(alias.name.split(".")[1:]))


def import_graph() -> dict:
    graph = {}
    for name, path in MODULES.items():
        graph[name] = {target for _, target in imported_modules(path) if target != name}
    return graph


def test_imports_point_down_only():
    upward = []
    for parts, path in MODULES.items():
        mine = layer_of(parts)
        for line, target in imported_modules(path):
            if layer_of(target) > mine:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports "
                              f"mpiddp.{'.'.join(target)}")
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


# The torch layer's rooms, bottom to top (docs/dev/architecture.md, "Inside torch/"): a room
# may import its own floor and those below it. The package's own ``__init__`` (the moved
# modules' old paths) stands above them all.
TORCH_FLOORS = [{"core"}, {"compression"}, {"ops"}, {"gradients"}, {"sharding"},
                {"optimizer"}, {"features"}]


def torch_floor_of(parts: tuple) -> int:
    if len(parts) == 1:
        return len(TORCH_FLOORS)                # torch/__init__
    for index, rooms in enumerate(TORCH_FLOORS):
        if parts[1] in rooms:
            return index
    raise AssertionError(f"mpiddp.{'.'.join(parts)} is in no room of the torch layer: put it "
                         "in one (TORCH_FLOORS and docs/dev/architecture.md)")


def test_the_torch_rooms_import_down_only():
    upward = []
    for parts, path in MODULES.items():
        if parts[0] != "torch":
            continue
        mine = torch_floor_of(parts)
        for line, target in imported_modules(path):
            if target[0] == "torch" and torch_floor_of(target) > mine:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports "
                              f"mpiddp.{'.'.join(target)}")
    assert not upward, "imports pointing up a floor of torch/:\n" + "\n".join(upward)


def test_no_import_cycles():
    """Tarjan's strongly connected components: any component of more than one module is a
    cycle (modules that can only be understood, and imported, together)."""
    graph = import_graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(".".join(member))
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: two modules that import each other are reported."""
    fake = {("a",): tmp_path / "a.py", ("b",): tmp_path / "b.py"}
    monkeypatch.setattr(sys.modules[__name__], "MODULES", fake)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import g\n")
    try:
        test_no_import_cycles()
    except AssertionError as exc:
        assert "a <-> b" in str(exc)
    else:
        raise AssertionError("a cycle went unnoticed")


def test_no_mpi_calls_in_the_torch_glue():
    for path in sorted((PACKAGE / "torch").rglob("*.py")):
        assert "mpi4py" not in path.read_text(), f"{path} uses MPI directly"


def test_every_layer_is_in_the_architecture_document():
    text = (PACKAGE.parent / "docs" / "dev" / "architecture.md").read_text()
    for names in LAYERS + [{f"torch/{room}/" for room in rooms} for rooms in TORCH_FLOORS]:
        for name in names - {"__init__"}:
            assert f"`{name}" in text, f"docs/dev/architecture.md does not place {name}"
