#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (docs/gpu.md, "Checking on a GPU machine"; the
# device plan: docs/dev/gpu.md):
#
#   bash scripts/gpu/gpu_check.sh [OUTPUT_DIR]    # default gpu-check/
#
# Uses the machine's own python3 with its CUDA torch and CuPy. MPI: the python3's mpi4py and
# mpiexec as found, unless WHEELS (default .whl/) holds mpi4py and mpich wheels: then they go
# into a virtual environment that sees the system's packages (a GPU machine with no package
# index can be handed the wheels this way: scripts/gpu/gpu_check_prepare.sh makes them). Parts,
# in this order, each under a time limit, with its output in OUTPUT_DIR/PART.txt:
#   machine    the GPU, driver, torch, CuPy, MPI library and whether it is CUDA-aware;
#   zero       tests/workers/zero_cuda_worker.py cuda on 2 ranks: zero_stage 1 and 2 (with and
#              without overlap_forward) bitwise against zero_stage=0, memory against the formula;
#   adasum     tests/workers/adasum_cuda_worker.py cuda on 2 ranks (the collective against the
#              float64 reference, the delta optimizer with GradScaler), then
#              benchmark_allreduce.py --adasum --device cuda (Adasum's busbw against Average);
#   horovod    Horovod's CUDA Adasum tests (test_orthogonal, test_parallel) through
#              scripts/horovod/horovod_suite.py, from HOROVOD (default .horovod/, see the
#              prepare script);
#   intelmpi   Intel MPI (an impi_rt wheel in WHEELS) with I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda:
#              what its query functions and mpiddp's probe answer, the per-collective GPU tests at
#              1 and 2 ranks (staged and direct), and the device all-reduce benchmark
#              (CUDA-aware mpiddp, staged, MPI_Allreduce on device buffers) up to 256 MiB;
#   tests      every GPU test (tests/test_gpu*.py, tests/test_cuda_aware.py; skips listed);
#   allreduce  scripts/bench/benchmark_allreduce.py --device cuda on 2 ranks;
#   training   scripts/bench/synthetic_benchmark.py --device cuda on 2 ranks: ResNet-18 on 224x224
#              images and the six-layer MLP, mpiddp (standard path, forward overlap) against
#              DDP and one process.
# PARTS (default: all of them) picks among them ("none": only the summary); TESTS gives the
# tests part's pytest arguments, TRAIN_VARIANTS (default mpiddp,overlap,ddp,single) the
# training part's --variants. TOTAL_LIMIT_S (default 570) bounds the whole run: a part starts
# only if the time it is expected to take is left (else the summary says "not run" and why),
# and runs under the smaller of its limit and what is left.
# MPS=1 runs everything under CUDA MPS (the script starts the daemon with its pipe and log in
# a directory of its own and stops it on exit): the ranks sharing one GPU then run their
# kernels side by side instead of time-slicing the GPU (docs/dev/gpu.md, "Measured on a GPU").
# Ends with a summary (also OUTPUT_DIR/summary.txt): per part, passed / failed / timed out /
# not run and why, its seconds, and its numbers. Exit status: 0 when no part failed or timed
# out (the benchmarks count as passed when they ran to the end).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUTDIR="$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)"
WHEELS="${WHEELS:-$ROOT/.whl}"
HOROVOD="${HOROVOD:-$ROOT/.horovod}"
TEST_LIMIT_S="${TEST_LIMIT_S:-300}"
BENCH_LIMIT_S="${BENCH_LIMIT_S:-90}"
TOTAL_LIMIT_S="${TOTAL_LIMIT_S:-570}"
ALL_PARTS="machine zero adasum horovod intelmpi tests allreduce training"
PARTS="${PARTS:-$ALL_PARTS}"
TRAIN_VARIANTS="${TRAIN_VARIANTS:-mpiddp,overlap,ddp,single}"
for p in $PARTS; do
  [[ " $ALL_PARTS none " == *" $p "* ]] ||
    { echo "PARTS: no part '$p' (parts: $ALL_PARTS)"; exit 2; }
done
export ROOT OUTDIR WHEELS HOROVOD TEST_LIMIT_S BENCH_LIMIT_S TRAIN_VARIANTS
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

if [ "$PARTS" != none ] && ls "$WHEELS"/mpi4py-*.whl "$WHEELS"/mpich-*.whl >/dev/null 2>&1; then
  # python3 may itself be a virtual environment (a venv made from it would not see its
  # packages): the new one reaches them through a .pth file, after its own mpi4py.
  VENV="${TMPDIR:-/tmp}/mpiddp-gpu-venv"
  SYSTEM_SITE="$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(
    torch.__file__)))')"
  python3 -m venv --without-pip "$VENV" || exit 1
  VSITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  python3 -m pip install -q --no-index --no-deps --ignore-installed --disable-pip-version-check \
    --prefix "$VENV" "$WHEELS"/mpi4py-*.whl "$WHEELS"/mpich-*.whl || exit 1
  echo "$SYSTEM_SITE" > "$VSITE/zz-system-packages.pth"
  export PATH="$VENV/bin:$PATH"
fi
export PYTHONPATH="$ROOT:$ROOT/tests/workers${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 \
  PYTHONUNBUFFERED=1

# ---- the parts: each runs in a shell of its own, under `timeout`; exit status 3: not run ----
part_machine() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 - <<'EOF' || return 1
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
  mpiexec -n 2 python3 -c "import mpiddp; mpiddp.init(); mpiddp.shutdown()"
}

part_zero() {
  MPIDDP_ALLREDUCE_ALGORITHM=ring mpiexec -n 2 python3 -m mpi4py \
    tests/workers/zero_cuda_worker.py cuda
}

part_adasum() {
  mpiexec -n 2 python3 -m mpi4py tests/workers/adasum_cuda_worker.py cuda || return 1
  mpiexec -n 2 python3 scripts/bench/benchmark_allreduce.py --device cuda --adasum --no-gloo \
    --max-size 64M --seconds 0.1 --json "$OUTDIR/adasum_cuda.json"
}

part_horovod() {
  if [ ! -f "$HOROVOD/test/parallel/test_adasum_pytorch.py" ]; then
    echo "[gpu_check] not run: no $HOROVOD/test/parallel/test_adasum_pytorch.py (make it" \
      "with scripts/gpu/gpu_check_prepare.sh HOROVOD_CHECKOUT, or set HOROVOD)"
    return 3
  fi
  python3 scripts/horovod/horovod_suite.py --horovod "$HOROVOD" --file test_adasum_pytorch.py \
    -k "test_orthogonal or test_parallel" --ranks 2 --share-gpus --timeout 120 \
    --json "$OUTDIR/horovod.json" || return 1
  python3 - "$OUTDIR/horovod.json" <<'EOF'
import json, sys
outcomes = json.load(open(sys.argv[1]))["2"]
print("[gpu_check] horovod:", {t.split("::")[-1]: o for t, (o, _) in outcomes.items()})
sys.exit(0 if len(outcomes) == 2 and all(o == "passed" for o, _ in outcomes.values()) else 1)
EOF
}

part_intelmpi() {
  if ! ls "$WHEELS"/impi_rt-*.whl "$WHEELS"/mpi4py-*.whl >/dev/null 2>&1; then
    echo "[gpu_check] not run: no impi_rt and mpi4py wheels in $WHEELS" \
      "(scripts/gpu/gpu_check_prepare.sh makes them)"
    return 3
  fi
  local venv="${TMPDIR:-/tmp}/mpiddp-impi-venv" site system_site
  system_site="$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(
    torch.__file__)))')"
  python3 -m venv --without-pip "$venv" || return 1
  python3 -m pip install -q --no-index --no-deps --ignore-installed \
    --disable-pip-version-check --prefix "$venv" "$WHEELS"/impi_rt-*.whl \
    "$WHEELS"/mpi4py-*.whl || return 1
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$system_site" > "$site/zz-system-packages.pth"
  export PATH="$venv/bin:$PATH" I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda I_MPI_PIN=0
  if ! python3 -c "import ctypes; ctypes.CDLL('libcuda.so')" 2>/dev/null; then
    export I_MPI_OFFLOAD_CUDA_LIBRARY=libcuda.so.1        # docs/gpu.md, "Intel MPI"
    echo "[gpu_check] libcuda.so cannot be loaded: I_MPI_OFFLOAD_CUDA_LIBRARY=libcuda.so.1"
  fi
  echo "[gpu_check] I_MPI_OFFLOAD=$I_MPI_OFFLOAD I_MPI_OFFLOAD_MODE=$I_MPI_OFFLOAD_MODE"
  python3 - <<'EOF' || return 1
import ctypes
from mpi4py import MPI
from mpiddp.transport import cuda_aware
print("[gpu_check]", MPI.Get_library_version().splitlines()[0])
probe = cuda_aware.probe()
print("[gpu_check] mpiddp's probe:", probe.describe(), "->", probe.supported)
lib = ctypes.CDLL(probe.library) if probe.library else None
for name in ("MPIX_Query_cuda_support", "MPIX_GPU_query_support", "MPIX_Query_ze_support"):
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        print(f"[gpu_check] {name}: not exported")
    elif name == "MPIX_GPU_query_support":
        answer = ctypes.c_int(-1)
        rc = fn(ctypes.c_int(0), ctypes.byref(answer))     # MPIX_GPU_SUPPORT_CUDA
        print(f"[gpu_check] {name}(CUDA): {answer.value} (return code {rc})")
    else:
        print(f"[gpu_check] {name}(): {fn()}")
EOF
  MPIDDP_LOG_LEVEL=info mpiexec -n 2 python3 -c "import mpiddp; mpiddp.init()
print('[gpu_check] rank', mpiddp.rank(), 'mpiddp.mpi_cuda_aware():', mpiddp.mpi_cuda_aware())
mpiddp.shutdown()" || return 1
  local t=tests/test_gpu.py::test_every_collective_on_cuda_matches_reference
  python3 -m pytest -q -rs -p no:cacheprovider "$t[0-1]" "$t[0-2]" "$t[auto-1]" "$t[auto-2]" \
    || return 1
  mpiexec -n 2 python3 scripts/bench/benchmark_allreduce.py --device cuda --no-gloo \
    --max-size 256M --seconds 0.1 --json "$OUTDIR/allreduce_intelmpi.json"
}

part_tests() {
  local tests
  read -r -a tests <<< "${TESTS:-tests/test_gpu.py tests/test_gpu_streams.py \
    tests/test_gpu_kernels.py tests/test_cuda_aware.py}"
  python3 -m pytest -q -rs -p no:cacheprovider "${tests[@]}"
}

part_allreduce() {
  mpiexec -n 2 python3 scripts/bench/benchmark_allreduce.py --device cuda --no-gloo \
    --max-size 64M --seconds 0.2 --json "$OUTDIR/allreduce_cuda.json"
}

part_training() {
  local model size_args rc=0
  for model in cnn mlp; do
    size_args=(); [ "$model" = cnn ] && size_args=(--image-size 224 --batch-size 64)
    timeout -k 10 "$BENCH_LIMIT_S" mpiexec -n 2 python3 scripts/bench/synthetic_benchmark.py \
      --model "$model" "${size_args[@]}" --device cuda --variants "$TRAIN_VARIANTS" || rc=1
  done
  return $rc
}

# A part's lines that go into the summary: its checks, counts and numbers.
numbers() {  # numbers PART FILE
  local checks='^(OK |\[gpu_check\] |[0-9]+ (passed|failed|skipped)|=+ .*(passed|failed|error))'
  local rows='^\| (4 KiB|1 MiB|64 MiB|256 MiB) \||^synchronous 4 KiB|CUDA-aware MPI:'
  case "$1" in
    adasum|intelmpi|allreduce) grep -E "$checks|$rows" "$2" ;;
    training) grep -E '^(model |mpiddp|overlap|ddp|single|.*throughput:)' "$2" ;;
    *) grep -E "$checks|^\[[0-9]+ ranks|^[0-9]+ ranks:|CUDA-aware probe|^torch |^NVIDIA " "$2" ;;
  esac | cut -c1-400
}

# Each part's limit, and the time it is expected to take on a 16-core one-GPU machine (an
# estimate until measured: docs/dev/gpu.md): a part starts only if that much is left of
# TOTAL_LIMIT_S, and then runs under the smaller of its limit and what is left.
LIMITS=(machine=60 zero=150 adasum=150 horovod=120 intelmpi=240 "tests=$TEST_LIMIT_S"
        "allreduce=$BENCH_LIMIT_S" "training=$((2 * BENCH_LIMIT_S + 20))")
EXPECTED=(machine=30 zero=60 adasum=90 horovod=60 intelmpi=150 tests=240 allreduce=45
          training=90)
lookup() {  # lookup NAME ENTRY... -> the value of NAME=VALUE
  local name=$1 entry; shift
  for entry in "$@"; do [ "${entry%%=*}" = "$name" ] && { echo "${entry#*=}"; return; }; done
  echo 60
}
summary=() failures=0
deadline=$((SECONDS + TOTAL_LIMIT_S))
for name in $ALL_PARTS; do
  [[ " $PARTS " == *" $name "* ]] || continue
  limit=$(lookup "$name" "${LIMITS[@]}")
  expected=$(lookup "$name" "${EXPECTED[@]}")
  left=$((deadline - SECONDS))
  if [ "$left" -lt "$expected" ]; then
    summary+=("$(printf '%-9s %-9s        needs about %s s, %s s of TOTAL_LIMIT_S=%s left' \
      "$name" "not run" "$expected" "$left" "$TOTAL_LIMIT_S")")
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "[gpu_check] part $name (limit $limit s)"
  started=$SECONDS
  timeout -k 10 "$limit" bash -c "$(declare -f "part_$name"); part_$name" 2>&1 |
    tee "$OUTDIR/$name.txt"
  rc=${PIPESTATUS[0]}
  took=$((SECONDS - started))
  case $rc in
    0) result=passed ;;
    3) result="not run" ;;
    124|137) result="timed out"; failures=$((failures + 1)) ;;
    *) result=failed; failures=$((failures + 1)) ;;
  esac
  summary+=("$(printf '%-9s %-9s %5s s  (exit %s; %s)' "$name" "$result" "$took" "$rc" \
    "$OUTDIR/$name.txt")")
  while IFS= read -r line; do summary+=("            $line"); done \
    < <(numbers "$name" "$OUTDIR/$name.txt")
  if [ "$result" = failed ] || [ "$result" = "timed out" ]; then     # where it stopped
    while IFS= read -r line; do summary+=("            | $line"); done \
      < <(grep -v '^\s*$' "$OUTDIR/$name.txt" | tail -n 3 | cut -c1-300)
  fi
done
{
  echo "[gpu_check] summary: $SECONDS s in all; parts: $PARTS"
  [ ${#summary[@]} -eq 0 ] || printf '%s\n' "${summary[@]}"
  echo "[gpu_check] $failures part(s) failed or timed out; outputs in $OUTDIR"
} | tee "$OUTDIR/summary.txt"
[ "$failures" -eq 0 ]
