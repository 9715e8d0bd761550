#!/usr/bin/env bash
# The multi-node benchmarks of docs/benchmarks.md ("Compression across nodes"; earlier rounds: docs/dev/benchmark-record.md, "Across nodes") in one command, as root:
#
#   sudo scripts/bench/cluster_benchmarks.sh [RATE] [OUTPUT]  # RATE: tc rate, default 1gbit
#
# Brings up an emulated cluster of 4 nodes (scripts/cluster/local_cluster.sh) with links shaped to
# RATE, runs on it the all-reduce benchmark at 2x1, 4x1 and 2x2 (mpiddp against native
# MPI_Allreduce) and the training benchmark at 2x1 (mpiddp against DDP over gloo on the same
# links; ResNet-18 and the MLP in fp32 and with fp16 compression on both, the MLP with bf16
# on mpiddp's side only, each against the perfect-overlap bound), and tears the cluster
# down, also on failure. PARTS=simulated (or PARTS="allreduce training simulated") runs the
# simulated accelerators instead (docs/benchmarks.md, "Simulated accelerators"): for each
# model of SIM_MODELS (default sim-resnet50 sim-bert), layout of SIM_LAYOUTS (2x1 4x1 2x2),
# regime of SIM_REGIMES (balanced compute wire: the one-process step 1x, 2x, 0.5x the wire
# time of the gradients at RATE) and compression of SIM_COMPRESSION (none fp16), the
# standard path, forward overlap (when the installed mpiddp has it), DDP-gloo (with its fp16
# hook under fp16) and one process, with parameters scaled by SIM_SCALE (default 0.25, so
# that a run takes about half a minute at 1gbit; 1 for the real sizes).
# Everything printed is also written to OUTPUT (default
# cluster-benchmarks.txt). Several ranks on this machine's
# cores: more ranks than cores set MPICH's heavy yield, so waiting ranks give the core back.
# MPI_GENV="NAME=VALUE ..." passes settings to every rank of every launch, e.g.
# MPI_GENV="UCX_RNDV_THRESH=inf" for UCX's eager protocol over TCP (docs/dev/engine.md, "Transfers across nodes").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RATE="${1:-1gbit}"
OUTPUT="${2:-cluster-benchmarks.txt}"
PARTS="${PARTS:-allreduce training}"
CLUSTER="$ROOT/scripts/cluster/local_cluster.sh"
case "$RATE" in
  *gbit) GBIT="${RATE%gbit}" ;;
  *mbit) GBIT="$(python3 -c "print(${RATE%mbit} / 1000)")" ;;
  *) echo "RATE must be like 1gbit or 500mbit" >&2; exit 2 ;;
esac
# shellcheck source=../ensure_env.sh
source "$ROOT/scripts/ensure_env.sh"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
CORES="$(getconf _NPROCESSORS_ONLN)"   # not nproc: it obeys OMP_NUM_THREADS

bash "$CLUSTER" up 4 "$RATE"
trap 'bash "$CLUSTER" down >/dev/null' EXIT

on_cluster() {        # on_cluster NxP command...: heavy yield where ranks outnumber cores
  local layout="$1"; shift
  local ranks=$(( ${layout%x*} * ${layout#*x} )) yield=() pair
  [ "$ranks" -gt "$CORES" ] && yield=(-genv MPIR_CVAR_ENABLE_HEAVY_YIELD 1)
  for pair in ${MPI_GENV:-}; do yield+=(-genv "${pair%%=*}" "${pair#*=}"); done
  echo; echo "### $layout: $*"
  bash "$CLUSTER" run "$layout" -- "${yield[@]}" "$@"
}

{
  echo "# mpiddp across nodes: $(date -u +%F), links $RATE, $CORES cores, $(git -C "$ROOT" rev-parse --short HEAD)${MPI_GENV:+, $MPI_GENV}"
  if [[ "$PARTS" == *allreduce* ]]; then
    for layout in 2x1 4x1 2x2; do
      on_cluster "$layout" python "$ROOT/scripts/bench/benchmark_allreduce.py" --no-gloo \
        --min-size 4K --max-size 64M --seconds 1 --min-iters 3
    done
  fi
  if [[ "$PARTS" == *training* ]]; then
    train=(python "$ROOT/scripts/bench/synthetic_benchmark.py" --threads 1 --link-gbit "$GBIT")
    on_cluster 2x1 "${train[@]}" --model cnn
    on_cluster 2x1 "${train[@]}" --model mlp
    on_cluster 2x1 "${train[@]}" --model mlp --compression fp16
    # DDP has no bf16 hook without NCCL: mpiddp against its own fp32 and fp16 runs above.
    on_cluster 2x1 "${train[@]}" --model mlp --compression bf16
    on_cluster 2x1 "${train[@]}" --model cnn --compression fp16
  fi
  if [[ "$PARTS" == *simulated* ]]; then
    variants=mpiddp,overlap,ddp,single
    if ! python -c 'import inspect, sys, mpiddp
sys.exit("overlap_forward" not in inspect.signature(mpiddp.DistributedOptimizer).parameters)'
    then
      echo "(this mpiddp has no forward overlap: the overlap variant is left out)"
      variants=mpiddp,ddp,single
    fi
    sim=(python "$ROOT/scripts/bench/synthetic_benchmark.py" --threads 1 --link-gbit "$GBIT"
         --param-scale "${SIM_SCALE:-0.25}" --warmup 1 --steps 3 --iters 3
         --variants "$variants")
    for model in ${SIM_MODELS:-sim-resnet50 sim-bert}; do
      for layout in ${SIM_LAYOUTS:-2x1 4x1 2x2}; do
        for regime in ${SIM_REGIMES:-balanced compute wire}; do
          for compression in ${SIM_COMPRESSION:-none fp16}; do
            on_cluster "$layout" "${sim[@]}" --model "$model" --regime "$regime" \
              --compression "$compression"
          done
        done
      done
    done
  fi
} 2>&1 | tee "$OUTPUT"
