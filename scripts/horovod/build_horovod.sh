#!/usr/bin/env bash
# Horovod 0.28.1 (PyTorch, MPI controller and ops, CPU) built against torch 2.13.0+cpu and the PyPI
# mpich 5.0.2 wheel, in its own venv (HVD_VENV, default ~/.cache/hvd-venv), for side-by-side runs on
# the same torch, MPI and links as mpiddp (docs/benchmarks.md, "Beside Horovod"). Idempotent.
# About 2.5 min of compiling on 2 cores.
# Patches: C++14 -> C++17 in CMakeLists.txt and horovod/torch/CMakeLists.txt (current torch headers
# need C++17; upstream fixed it after 0.28.1). PyPI's cmake 4 needs CMAKE_POLICY_VERSION_MINIMUM for
# Gloo's old cmake_minimum_required. mpiddp is installed editable into the same venv (--no-deps), so
# one launcher and one libmpi serve every implementation in a comparison.
set -eu
V=${HVD_VENV:-$HOME/.cache/hvd-venv}
PROJ=${PROJ:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}   # this checkout
if [ -x "$V/bin/python" ] && "$V/bin/python" -c "import horovod.torch" 2>/dev/null; then
  "$V/bin/pip" install -q --no-deps --no-build-isolation -e "$PROJ" >/dev/null 2>&1 || true
  exit 0
fi
B=$(mktemp -d)
python3 -m venv "$V"
"$V/bin/pip" install -q torch==2.13.0 mpi4py mpich==5.0.2 numpy cloudpickle psutil pyyaml packaging cffi cmake
cd "$B"
"$V/bin/pip" download -q --no-deps --no-binary :all: horovod==0.28.1
tar xzf horovod-0.28.1.tar.gz
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' horovod-0.28.1/CMakeLists.txt \
  horovod-0.28.1/horovod/torch/CMakeLists.txt
export PATH="$V/bin:$PATH" VIRTUAL_ENV="$V" MAKEFLAGS=-j2 CMAKE_BUILD_PARALLEL_LEVEL=2 \
  CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI \
  CC="$V/bin/mpicc" CXX="$V/bin/mpicxx"
nice -n 19 "$V/bin/pip" install -q --no-build-isolation --no-deps ./horovod-0.28.1
"$V/bin/pip" install -q --no-deps --no-build-isolation -e "$PROJ" >/dev/null 2>&1
cd /; rm -rf "$B"
"$V/bin/python" -c "import horovod.torch as hvd; print('horovod', hvd.__version__ if hasattr(hvd, '__version__') else 'ok')"
