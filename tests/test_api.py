"""The public API is readable: ``mpiddp.__all__`` lists exactly what the package re-exports,
and every public function, class and method has type hints and a Google-style docstring
(Args / Returns / Raises), so that an IDE shows a user what a call takes, returns and raises.
The package ships its type hints (PEP 561 ``py.typed``). No MPI launch: import only."""
import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest

import mpiddp
from mpiddp import build_info, checkpoint, process_sets, runtime
from mpiddp.torch import compression, optimizer
from mpiddp.torch.features import profiler, sync_batch_norm
from mpiddp.torch.ops import async_ops, collectives, functions, handles, requests
from mpiddp.torch.sharding import mixed_precision
from mpiddp.torch.sharding import optimizer as zero_optimizer

ROOT = Path(__file__).parent.parent
PUBLIC_MODULES = [mpiddp, runtime, handles, async_ops, collectives, requests, functions,
                  optimizer, compression, build_info, process_sets, sync_batch_norm,
                  checkpoint, zero_optimizer, profiler, mixed_precision]

# Functions that raise nothing of their own (no "Raises:" section needed).
RAISES_NOTHING = {"is_initialized", "mpi_threads_supported", "shutdown",
                  # the build/backend probes answer constants
                  "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built",
                  "ccl_built", "ddl_built", "cuda_built", "rocm_built"}


def public_functions():
    """(qualified name, function) for every public function and public method."""
    seen = {}
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                seen.setdefault(f"{obj.__module__}.{obj.__qualname__}", obj)
            elif inspect.isclass(obj):
                for qualified, method in public_methods(obj):
                    seen.setdefault(qualified, method)
    # The methods DistributedOptimizer puts in front of the wrapped optimizer's class.
    for qualified, method in public_methods(optimizer._DistributedOptimizer):
        seen.setdefault(qualified, method)
    for qualified, method in public_methods(zero_optimizer.ShardedOptimizer):   # zero_stage
        seen.setdefault(qualified, method)
    return sorted(seen.items())


def public_methods(cls):
    """Public methods and properties of ``cls`` defined in mpiddp, inherited ones included
    (e.g. ``FP16Compressor.compress`` comes from a private base)."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith("mpiddp"):
            continue
        for name, member in vars(klass).items():
            if name.startswith("_"):
                continue
            where = f"{klass.__module__}.{klass.__qualname__}.{name}"
            if isinstance(member, property):
                yield where, member.fget
            elif isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
                yield where, getattr(klass, name)


def takes_arguments(fn) -> bool:
    return bool(list(inspect.signature(fn).parameters))


FUNCTIONS = public_functions()


def test_all_lists_exactly_the_reexported_names():
    exported = {name for name, value in vars(mpiddp).items()
                if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert len(mpiddp.__all__) == len(set(mpiddp.__all__)), "duplicates in mpiddp.__all__"
    assert set(mpiddp.__all__) == exported, (
        f"missing from __all__: {sorted(exported - set(mpiddp.__all__))}; "
        f"in __all__ but not exported: {sorted(set(mpiddp.__all__) - exported)}")


@pytest.mark.parametrize("module", PUBLIC_MODULES, ids=lambda m: m.__name__)
def test_public_modules_declare_existing_documented_names(module):
    assert module.__doc__ and module.__doc__.strip(), f"{module.__name__} has no docstring"
    for name in module.__all__:
        assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name!r}"
        doc = inspect.getdoc(getattr(module, name))
        assert doc and doc.strip(), f"{module.__name__}.{name} has no docstring"


def test_reexports_come_from_the_public_modules():
    # Every top-level name is declared public where it is defined (or is an exception/op).
    declared = set().union(*(set(m.__all__) for m in PUBLIC_MODULES[1:]))
    from mpiddp import errors, reduce_ops
    for name in mpiddp.__all__:
        home = getattr(mpiddp, name)
        if isinstance(home, reduce_ops.ReduceOp) or name == "ReduceOp":
            continue
        if inspect.isclass(home) and issubclass(home, errors.MpiddpError):
            continue
        assert name in declared, f"mpiddp.{name} is not in its module's __all__"


@pytest.mark.parametrize("qualified,fn", FUNCTIONS, ids=[q for q, _ in FUNCTIONS])
def test_public_function_is_documented_and_annotated(qualified, fn):
    doc = inspect.getdoc(fn)
    assert doc and doc.strip(), f"{qualified} has no docstring"
    signature = inspect.signature(fn)
    for name, parameter in signature.parameters.items():
        if name in ("self", "cls"):
            continue
        assert parameter.annotation is not inspect.Parameter.empty, \
            f"{qualified}: parameter {name!r} has no type hint"
        assert f"{name}:" in doc, f"{qualified}: parameter {name!r} is not described"
    assert signature.return_annotation is not inspect.Signature.empty, \
        f"{qualified} has no return type hint"
    if takes_arguments(fn) and list(signature.parameters) not in (["self"], ["cls"]):
        assert "Args:" in doc, f"{qualified} has no Args: section"
    returns_something = signature.return_annotation not in (None, "None")
    is_property_or_cm = qualified.endswith((".names", ".backward_passes_per_step",
                                            ".skip_synchronize"))
    if returns_something and not is_property_or_cm:
        assert "Returns:" in doc, f"{qualified} has no Returns: section"
    is_module_function = fn.__qualname__ == fn.__name__
    if is_module_function and fn.__name__ not in RAISES_NOTHING:
        assert "Raises:" in doc, f"{qualified} has no Raises: section"


def test_classes_and_constants_are_documented():
    for name in mpiddp.__all__:
        obj = getattr(mpiddp, name)
        if inspect.isclass(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"mpiddp.{name} has no docstring"
    for member in mpiddp.ReduceOp:
        assert member.name.upper() in mpiddp.ReduceOp.__doc__, f"{member.name} undocumented"


def test_package_ships_py_typed():
    assert (ROOT / "mpiddp" / "py.typed").is_file()
    setup_cfg = (ROOT / "setup.cfg").read_text()
    assert "[options.package_data]" in setup_cfg and "py.typed" in setup_cfg


def public_api_lines() -> list[str]:
    """Every name of ``mpiddp.__all__`` with its signature (functions), its public methods'
    signatures (classes) or its value (constants)."""
    lines = []
    for name in sorted(mpiddp.__all__):
        obj = getattr(mpiddp, name)
        if inspect.isfunction(obj):
            lines.append(f"{name}{inspect.signature(obj)}")
        elif inspect.isclass(obj):
            lines.append(f"class {name}")
            for attr in sorted(vars(obj)):
                member = getattr(obj, attr)
                if attr.startswith("_") or not callable(member) or inspect.isclass(member):
                    continue
                try:
                    lines.append(f"  {name}.{attr}{inspect.signature(member)}")
                except (TypeError, ValueError):
                    pass
        else:
            lines.append(f"{name} = {obj!r}")
    return lines


def test_public_api_matches_the_recorded_one():
    """Names and signatures as recorded in tests/data/public_api.txt: a change to the public
    API is deliberate (update the file in the same commit), never a side effect."""
    recorded = (ROOT / "tests" / "data" / "public_api.txt").read_text().splitlines()
    current = public_api_lines()
    added, removed = sorted(set(current) - set(recorded)), sorted(set(recorded) - set(current))
    assert not added and not removed, f"added: {added}\nremoved: {removed}"



def test_import_leaves_torch_compile_machinery_unloaded():
    # torch._dynamo costs about 2.5 s of CPU to import: every rank of every job would pay it
    # at `import mpiddp` (it is loaded only when forward overlap first runs).
    probe = ("import sys, mpiddp\n"
             "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
