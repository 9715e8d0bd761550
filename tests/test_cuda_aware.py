"""The CUDA-aware probe's decision table (``mpiddp.transport.cuda_aware.interpret``), row by
row, and the probe itself against stub MPI libraries: tiny shared objects built here with the
system C compiler, each exporting one vendor's version string and query functions, loaded
through the same ctypes path as the real library. No GPU and no CUDA-aware MPI needed."""
from __future__ import annotations

import logging
import shutil
import subprocess

import pytest

from mpiddp.transport import cuda_aware
from mpiddp.transport.cuda_aware import Answers, interpret

OMPI_40 = "Open MPI v4.0.5, package: Open MPI builder Distribution, ident: 4.0.5, repo rev: v4.0.5"
OMPI_41 = "Open MPI v4.1.6, package: Open MPI builder Distribution, ident: 4.1.6"
OMPI_3 = "Open MPI v3.1.6, package: Open MPI builder Distribution, ident: 3.1.6"
OMPI_5RC = "Open MPI v5.0.0rc12, package: Open MPI builder Distribution, ident: 5.0.0rc12"
OMPI_5 = "Open MPI v5.0.3, package: Open MPI builder Distribution, ident: 5.0.3"
MPICH = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024\nMPICH Device: ch4:ucx"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)\nMPI BUILD INFO : ..."
MVAPICH = "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022"
INTEL = "Intel(R) MPI Library 2021.14 for Linux* OS"
OTHER = "Some Vendor MPI 1.0"
_CUDA = {"I_MPI_OFFLOAD": "1", "I_MPI_OFFLOAD_MODE": "cuda"}

# (row, version, MPIX_GPU_query_support flag, MPIX_Query_cuda_support(), environment,
#  expected supported: True yes / False no / None unsure, text the reason must contain)
ROWS = [
    ("ompi 4.0 built with CUDA: build flag, unsure", OMPI_40, None, 1, {}, None, "build flag"),
    ("ompi 3.1 built with CUDA: build flag, unsure", OMPI_3, None, 1, {}, None, "build flag"),
    ("ompi 4.0 without CUDA", OMPI_40, None, 0, {}, False, "without CUDA"),
    ("ompi 4.1 run-time yes", OMPI_41, None, 1, {}, True, ""),
    ("ompi 4.1 run-time no", OMPI_41, None, 0, {}, False, ""),
    ("ompi 5 rc answers 0: unsure", OMPI_5RC, None, 0, {}, None, "release candidate"),
    ("ompi 5 rc answers 1", OMPI_5RC, None, 1, {}, True, ""),
    ("ompi 5 release no", OMPI_5, None, 0, {}, False, ""),
    ("ompi 5 release yes", OMPI_5, None, 1, {}, True, ""),
    ("mpich gpu query yes", MPICH, 1, 1, {}, True, ""),
    ("mpich gpu query no", MPICH, 0, 0, {}, False, ""),
    ("mpich only the cuda query", MPICH, None, 1, {}, True, ""),
    ("cray without the switch", CRAY, 1, 1, {}, False, "MPICH_GPU_SUPPORT_ENABLED=1"),
    ("cray switch 0", CRAY, 1, 1, {"MPICH_GPU_SUPPORT_ENABLED": "0"}, False, "it is 0"),
    ("cray with the switch", CRAY, 1, None, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, True, ""),
    ("cray with the switch, query no", CRAY, 0, None, {"MPICH_GPU_SUPPORT_ENABLED": "1"},
     False, ""),
    ("cray with the switch, no query", CRAY, None, None, {"MPICH_GPU_SUPPORT_ENABLED": "1"},
     True, "MPICH_GPU_SUPPORT_ENABLED=1"),
    ("mvapich2 with MV2_USE_CUDA=1", MVAPICH, None, None, {"MV2_USE_CUDA": "1"}, True,
     "MV2_USE_CUDA=1"),
    ("mvapich2 without MV2_USE_CUDA", MVAPICH, None, None, {}, False, "not set"),
    ("mvapich2 MV2_USE_CUDA=0", MVAPICH, None, None, {"MV2_USE_CUDA": "0"}, False, "not set"),
    # Intel MPI exports both queries, which answer 0 without offload (2021.14, seen here).
    ("intel without I_MPI_OFFLOAD", INTEL, 0, 0, {}, False, "I_MPI_OFFLOAD=1 set"),
    ("intel I_MPI_OFFLOAD=0", INTEL, 0, 0, dict(_CUDA, I_MPI_OFFLOAD="0"), False, "it is 0"),
    ("intel offload in the cuda mode", INTEL, 0, 0, _CUDA, True, "I_MPI_OFFLOAD_MODE=cuda"),
    ("intel offload, another true value", INTEL, 0, 0, dict(_CUDA, I_MPI_OFFLOAD="2"), True,
     "I_MPI_OFFLOAD=2"),
    ("intel offload in the level_zero mode", INTEL, 0, 0,
     dict(_CUDA, I_MPI_OFFLOAD_MODE="level_zero"), False, "not CUDA's"),
    ("intel offload in the auto mode: unsure", INTEL, 0, 0, {"I_MPI_OFFLOAD": "1"}, None,
     "set I_MPI_OFFLOAD_MODE=cuda"),
    ("intel offload in the auto mode, a query yes", INTEL, 1, 0, {"I_MPI_OFFLOAD": "1"},
     True, "I_MPI_OFFLOAD_MODE=auto"),
    ("I_MPI_OFFLOAD under mpich: not its switch", MPICH, 0, 0, _CUDA, False,
     "this MPI is not Intel MPI"),
    ("unknown library without a query", OTHER, None, None, {}, None, ""),
]


@pytest.mark.parametrize("row,version,gpu,cuda,environ,expected,reason", ROWS,
                         ids=[r[0] for r in ROWS])
def test_decision_table(row, version, gpu, cuda, environ, expected, reason):
    found = interpret(Answers(version, gpu, cuda), environ, "/opt/mpi/lib/libmpi.so.40")
    assert found.supported is expected, found
    assert reason in found.reason, found
    decision = cuda_aware.decide("auto", found)
    assert decision.cuda_aware is (expected is True)      # unsure: staged through host memory
    text = decision.describe()
    assert text.startswith("yes" if expected else "no"), text
    if expected is None and found.query is not None:
        assert "says unsure" in text and found.reason in text, text


def test_unsure_answer_is_logged_with_its_reason(monkeypatch, caplog):
    unsure = interpret(Answers(OMPI_40, None, 1), {}, "/opt/ompi/lib/libmpi.so.40")
    monkeypatch.setattr(cuda_aware, "probe", lambda: unsure)
    try:
        with caplog.at_level(logging.WARNING, logger="mpiddp"):
            decision = cuda_aware.configure("auto")
        assert decision.cuda_aware is False
        assert "unsure" in caplog.text and "build flag" in caplog.text, caplog.text
        assert "MPIDDP_CUDA_AWARE=1" in caplog.text
    finally:
        cuda_aware.reset()


def test_offload_asked_for_and_not_had_is_a_warning(monkeypatch, caplog):
    """I_MPI_OFFLOAD=1 where device buffers cannot go to MPI (another MPI, Intel MPI's Level
    Zero mode) stages, and says why."""
    for version, environ, needle in [
            (MPICH, _CUDA, "this MPI is not Intel MPI"),
            (INTEL, dict(_CUDA, I_MPI_OFFLOAD_MODE="level_zero"), "not CUDA's")]:
        found = interpret(Answers(version, 0, 0), environ, "/opt/mpi/lib/libmpi.so.12")
        monkeypatch.setattr(cuda_aware, "probe", lambda: found)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger="mpiddp"):
                assert cuda_aware.configure("auto").cuda_aware is False
        finally:
            cuda_aware.reset()
        assert "I_MPI_OFFLOAD=1 asks Intel MPI to take device buffers, but" in caplog.text
        assert needle in caplog.text and "staged through host memory" in caplog.text


# ---- Intel MPI's switches before MPI starts ------------------------------------------------
def _loads(*present):
    """A stand-in for ``intel_mpi.load_error``: the libraries in ``present`` load."""
    return lambda name: None if name in present else f"{name}: cannot open shared object file"


@pytest.mark.parametrize("environ, present, needles", [
    ({}, (), None),                                            # no offload: nothing to load
    ({"I_MPI_OFFLOAD": "0"}, (), None),
    ({"I_MPI_OFFLOAD": "-1"}, (), None),              # Intel MPI disables offload on it
    (_CUDA, ("libcuda.so",), None),
    (dict(_CUDA, I_MPI_OFFLOAD_CUDA_LIBRARY="libcuda.so.1"), ("libcuda.so.1",), None),
    ({"I_MPI_OFFLOAD": "1"}, ("libze_loader.so.1",), None),    # auto finds Level Zero
    (dict(_CUDA, I_MPI_OFFLOAD_MODE="level_zero"), (), None),  # Intel MPI says why itself
    (_CUDA, ("libcuda.so.1",), ["I_MPI_OFFLOAD=1 asks Intel MPI to take GPU buffers "
                                "(I_MPI_OFFLOAD_MODE=cuda)", "libcuda.so: cannot open",
                                "crash in MPI_Init", "I_MPI_OFFLOAD_CUDA_LIBRARY=libcuda.so.1",
                                "unset I_MPI_OFFLOAD"]),
    ({"I_MPI_OFFLOAD": "1"}, (), ["I_MPI_OFFLOAD_MODE=auto (the default), and Level Zero "
                                  "(libze_loader.so.1) cannot be loaded either"]),
    (dict(_CUDA, I_MPI_OFFLOAD_MODE="CUDA"), ("libcuda.so",),
     ["I_MPI_OFFLOAD_MODE=CUDA, which is not one of auto, cuda, level_zero"]),
])
def test_intel_offload_that_would_crash_mpi_init(environ, present, needles):
    from mpiddp.intel_mpi import offload_crash
    reason = offload_crash(environ, load=_loads(*present))
    if needles is None:
        assert reason is None, reason
    else:
        assert reason is not None
        for needle in needles:
            assert needle in reason, reason


def test_the_offload_check_runs_only_before_an_intel_mpi_starts():
    from mpiddp.errors import LaunchError
    from mpiddp.intel_mpi import likely_intel_mpi
    from mpiddp.runtime.mpi_environment import refuse_crashing_offload
    crash = lambda environ: "it would crash"          # noqa: E731
    assert likely_intel_mpi({"I_MPI_HYDRA_UUID": "8574-..."}, installed=lambda: False)
    assert likely_intel_mpi({"I_MPI_PMI_LIBRARY": "/usr/lib/libpmi2.so"}, installed=lambda: False)
    assert likely_intel_mpi({}, installed=lambda: True)
    assert not likely_intel_mpi({"I_MPI_OFFLOAD": "1"}, installed=lambda: False)
    intel = {"I_MPI_ROOT": "/opt/intel/mpi", "I_MPI_OFFLOAD": "1"}
    with pytest.raises(LaunchError, match="it would crash"):
        refuse_crashing_offload(intel, modules={}, crash=crash)
    refuse_crashing_offload(intel, modules={"mpi4py.MPI": None},
                            crash=crash)                    # MPI started: too late, no check
    refuse_crashing_offload(dict(intel, I_MPI_OFFLOAD="0"), modules={}, crash=crash)


def test_intel_mpi_with_offload_and_no_cuda_driver_stops_with_the_reason(tmp_path):
    """Under Intel MPI (scripts/dev/test_intelmpi.sh), I_MPI_OFFLOAD=1 with a CUDA driver library
    that cannot be loaded crashes MPI_Init with a segmentation fault; importing mpiddp first
    refuses with the reason instead, on every rank."""
    from mpi4py import MPI
    if "Intel(R) MPI" not in MPI.Get_library_version():
        pytest.skip("needs Intel MPI (scripts/dev/test_intelmpi.sh)")
    from mpi_launch import assert_ok, run_mpi
    script = tmp_path / "start.py"
    script.write_text("import mpiddp\nmpiddp.init()\nprint('OK started', flush=True)\n")
    missing = str(tmp_path / "libcuda.so")
    result = run_mpi(str(script), 2, timeout=60, mpi4py_run=False, env={
        **_CUDA, "I_MPI_OFFLOAD_CUDA_LIBRARY": missing})
    assert not result.timed_out and result.returncode != 0, result.output
    assert "Segmentation fault" not in result.output, result.output
    assert result.output.count("LaunchError: I_MPI_OFFLOAD=1 asks Intel MPI to take GPU "
                               "buffers") == 2, result.output
    assert f"{missing}: cannot open shared object file" in result.output, result.output
    # ... and with the switch off, the same launch runs.
    assert_ok(run_mpi(str(script), 2, timeout=60, mpi4py_run=False,
                      env={**_CUDA, "I_MPI_OFFLOAD": "0"}), expect_lines=2)


# ---- stub MPI libraries -------------------------------------------------------------------
def _compiler():
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _stub(tmp_path, name: str, version: str, gpu=None, cuda=None) -> str:
    """A shared object that exports MPI_Get_library_version and, where given, the vendor's
    query functions with fixed answers."""
    literal = version.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") \
        .replace("\t", "\\t")
    source = ['#include <string.h>',
              'int MPI_Get_library_version(char *v, int *n) {',
              f'  const char *s = "{literal}"; strcpy(v, s); *n = (int)strlen(s); return 0;',
              '}']
    if gpu is not None:
        source += ['int MPIX_GPU_query_support(int type, int *flag) {',
                   f'  *flag = type == 0 ? {int(gpu)} : 0; return 0;', '}']
    if cuda is not None:
        source += [f'int MPIX_Query_cuda_support(void) {{ return {int(cuda)}; }}']
    c_file = tmp_path / f"{name}.c"
    c_file.write_text("\n".join(source) + "\n")
    library = tmp_path / f"lib{name}.so"
    subprocess.run([_compiler(), "-shared", "-fPIC", "-o", str(library), str(c_file)],
                   check=True, timeout=60)
    return str(library)


@pytest.mark.skipif(_compiler() is None, reason="no C compiler to build the stub libraries")
@pytest.mark.parametrize("row,version,gpu,cuda,environ,expected,reason", ROWS,
                         ids=[r[0] for r in ROWS])
def test_probe_of_stub_libraries(tmp_path, row, version, gpu, cuda, environ, expected, reason):
    # Not named like an MPI library: loaded, it stays mapped, and the probe of the real
    # library (tests/test_gpu.py) looks for MPI libraries among the mapped files.
    path = _stub(tmp_path, "vendor_stub", version, gpu, cuda)
    found = cuda_aware.probe([str(tmp_path / "absent.so"), path], environ=environ)
    assert found.library == path
    assert found.supported is expected, found
    assert reason in found.reason, found
    if gpu is not None and not any(name in version for name in ("CRAY", "Open MPI", "Intel")):
        assert found.query == cuda_aware.GPU_QUERY
