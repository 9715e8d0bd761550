#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (docs/gpu.md, "Checking on a GPU machine"):
#
#   bash scripts/gpu_check.sh [OUTPUT_DIR]        # default gpu-check/
#
# Uses the machine's own python3 with its CUDA torch and CuPy. MPI: the python3's mpi4py and
# mpiexec as found, unless WHEELS (default .whl/) holds mpi4py and mpich wheels: then they go
# into a virtual environment that sees the system's packages (a GPU machine with no package
# index can be handed the wheels this way). Runs, each under a time limit, with its output in
# OUTPUT_DIR:
#   1. the machine: GPU, driver, torch, CuPy, MPI library and whether it is CUDA-aware;
#   2. every GPU test (tests/test_gpu*.py, tests/test_cuda_aware.py; skips listed with reason);
#   3. scripts/benchmark_allreduce.py --device cuda on 2 ranks (sharing the GPU if only one);
#   4. scripts/synthetic_benchmark.py --device cuda on 2 ranks: ResNet-18 on 224x224 images and
#      the six-layer MLP, mpiddp (standard path and forward overlap) against DDP and one process.
# PARTS (default "machine tests allreduce training") picks among them; TESTS (default: those
# files) gives step 2's pytest arguments, TRAIN_VARIANTS (default mpiddp,overlap,ddp,single)
# step 4's --variants. MPS=1 runs everything under CUDA MPS (the script starts the daemon
# with its pipe and log in a directory of its own and stops it on exit): the ranks sharing
# one GPU then run their kernels side by side instead of time-slicing the GPU, the nearest a
# one-GPU machine comes to a GPU per rank (docs/dev/gpu.md, "Measured on a GPU").
# Exit status: the tests' (the benchmarks are for reading).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)"
WHEELS="${WHEELS:-$ROOT/.whl}"
TEST_LIMIT_S="${TEST_LIMIT_S:-300}"
BENCH_LIMIT_S="${BENCH_LIMIT_S:-90}"
PARTS="${PARTS:-machine tests allreduce training}"
TRAIN_VARIANTS="${TRAIN_VARIANTS:-mpiddp,overlap,ddp,single}"
part() { [[ " $PARTS " == *" $1 "* ]]; }
status=0
cd "$ROOT"

if [ "${MPS:-0}" = 1 ]; then
  command -v nvidia-cuda-mps-control >/dev/null ||
    { echo "MPS=1: no nvidia-cuda-mps-control"; exit 1; }
  MPS_DIR="$(mktemp -d "${TMPDIR:-/tmp}/mpiddp-mps.XXXXXX")"
  export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "MPS=1: the MPS daemon did not start"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$MPS_DIR"' EXIT
  echo "[gpu_check] under CUDA MPS (pipe $CUDA_MPS_PIPE_DIRECTORY)" | tee "$OUTDIR/mps.txt"
fi

if ls "$WHEELS"/mpi4py-*.whl "$WHEELS"/mpich-*.whl >/dev/null 2>&1; then
  # python3 may itself be a virtual environment (a venv made from it would not see its
  # packages): the new one reaches them through a .pth file, after its own mpi4py.
  VENV="${TMPDIR:-/tmp}/mpiddp-gpu-venv"
  SYSTEM_SITE="$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(
    torch.__file__)))')"
  python3 -m venv --without-pip "$VENV" || exit 1
  VSITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  python3 -m pip install -q --no-index --no-deps --ignore-installed --disable-pip-version-check \
    --prefix "$VENV" "$WHEELS"/*.whl || exit 1
  echo "$SYSTEM_SITE" > "$VSITE/zz-system-packages.pth"
  export PATH="$VENV/bin:$PATH"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

part machine && {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 - <<'EOF'
import torch, cupy, mpi4py
from mpi4py import MPI
from mpiddp.transport import cuda_aware
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CuPy {cupy.__version__}, "
      f"mpi4py {mpi4py.__version__}, GPUs {torch.cuda.device_count()}")
print(MPI.Get_library_version().splitlines()[0])
print("CUDA-aware probe:", cuda_aware.probe())
print("cuda:0 UUID:", torch.cuda.get_device_properties(0).uuid)
EOF
  echo "mpiexec: $(command -v mpiexec)"
  # two ranks on a one-GPU machine share it: init() should say so (docs/gpu.md)
  timeout -k 10 60 mpiexec -n 2 python3 -c "import mpiddp; mpiddp.init(); mpiddp.shutdown()"
} 2>&1 | tee "$OUTDIR/machine.txt"

if part tests; then
  read -r -a tests <<< "${TESTS:-tests/test_gpu.py tests/test_gpu_streams.py \
    tests/test_gpu_kernels.py tests/test_cuda_aware.py}"
  timeout -k 10 "$TEST_LIMIT_S" python3 -m pytest -q -rs -p no:cacheprovider "${tests[@]}" \
    2>&1 | tee "$OUTDIR/tests.txt"
  status=${PIPESTATUS[0]}
fi

part allreduce && timeout -k 10 "$BENCH_LIMIT_S" mpiexec -n 2 python3 \
  scripts/benchmark_allreduce.py --device cuda --no-gloo --max-size 64M --seconds 0.2 \
  --json "$OUTDIR/allreduce_cuda.json" 2>&1 | tee "$OUTDIR/allreduce_cuda.txt"
part training && for model in cnn mlp; do
  size_args=(); [ "$model" = cnn ] && size_args=(--image-size 224 --batch-size 64)
  timeout -k 10 "$BENCH_LIMIT_S" mpiexec -n 2 python3 scripts/synthetic_benchmark.py \
    --model "$model" "${size_args[@]}" --device cuda --variants "$TRAIN_VARIANTS" \
    2>&1 | tee "$OUTDIR/train_$model.txt"
done
echo "[gpu_check] tests exit status $status; outputs in $OUTDIR"
exit "$status"
