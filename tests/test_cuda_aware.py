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
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS"

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
    ("unknown library without a query", INTEL, None, None, {}, None, ""),
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
    if gpu is not None and "CRAY" not in version and "Open MPI" not in version:
        assert found.query == cuda_aware.GPU_QUERY
