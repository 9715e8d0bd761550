"""The package's layers import downwards only (shared/DESIGN.md): a module may import its own
layer and the layers below it, never one above. This keeps import cycles out and the ring in
``collectives/``, the negotiation in ``engine/`` and every MPI call out of ``torch/``."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "mpiddp"

# Lower index = lower layer. Modules at the package root are listed by name.
LAYERS = [
    {"ops", "errors", "config"},
    {"buffers"},
    {"transport"},
    {"collectives"},
    {"engine"},
    {"gpu", "launch_check", "runtime", "build_info", "process_sets"},
    {"torch"},
    {"__init__"},
]


def layer_of(parts: tuple) -> int:
    top = parts[0]
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"mpiddp.{'.'.join(parts)} is in no layer: add it to LAYERS")


def imported_modules(path: Path):
    """(line, mpiddp-relative module parts) for every import of a mpiddp module in ``path``."""
    relative = path.relative_to(PACKAGE).with_suffix("").parts
    package = relative[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            target = base + tuple(node.module.split(".")) if node.module else base
            if target:
                yield node.lineno, target
            else:                                  # from . import x (package root)
                for alias in node.names:
                    yield node.lineno, (alias.name,)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpiddp."):
            yield node.lineno, tuple(node.module.split(".")[1:])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mpiddp."):
                    yield node.lineno, tuple(alias.name.split(".")[1:])


def test_imports_point_down_only():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        mine = layer_of(parts)
        for line, target in imported_modules(path):
            if layer_of(target) > mine:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports "
                              f"mpiddp.{'.'.join(target)}")
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


def test_no_mpi_calls_in_the_torch_glue():
    for path in sorted((PACKAGE / "torch").rglob("*.py")):
        assert "mpi4py" not in path.read_text(), f"{path} uses MPI directly"
