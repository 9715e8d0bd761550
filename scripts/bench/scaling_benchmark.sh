#!/usr/bin/env bash
# Scaling curves on the emulated cluster (docs/benchmarks.md, "Scaling to 16 nodes"), as root:
#
#   sudo scripts/bench/scaling_benchmark.sh [OUTPUT_DIR]
#
# For each setting of SETTINGS (default "light heavy"), brings up 16 emulated nodes
# (scripts/cluster/local_cluster.sh) and, for each node count of NODES (default "2 4 8 16", one rank
# per node) and regime of REGIMES (default "compute balanced wire": the one-process step 2x,
# 1x, 0.5x the wire time of the gradients at that N), runs the simulated accelerator model
# MODEL (default sim-resnet50) with VARIANTS (default: the standard path, forward overlap,
# every reduction through MPI_Allreduce, DDP-gloo and one process) side by side in one launch,
# and writes each launch's JSON and output to OUTPUT_DIR (default scaling-results/).
# PARTS (default "training allreduce") also runs scripts/bench/benchmark_allreduce.py (4 KiB-64 MiB:
# mpiddp's algorithms, MPI_Allreduce and gloo) at each node count, on the links of the
# settings in ALLREDUCE_SETTINGS (default heavy: 1 Gbit/s), into allreduce-<setting>-<N>x1.*.
# RANKS_PER_NODE (default 1) runs that many ranks on each node (NxG launches and files; the
# all-reduce part then also runs 1xG, the node-local link `scaling_model.py` fits): nodes of
# several GPUs, sharing the node's link.
# LINK_SCALE (default 1) shapes the links to that fraction of the setting's rate while the
# regimes keep the nominal rate's wire time: LINK_SCALE=0.5 is "the same run at half the link
# rate" (`plot_scaling.py DIR --against HALF_DIR` compares the two).
#
#   light: 200 Mbit/s links, parameters scaled by 0.05: the same wire time as 1 Gbit/s at
#          0.25, a fifth of the bytes; what it measures is the network and the algorithms.
#   heavy: 1 Gbit/s links, parameters scaled by 0.25: five times the bytes per second of
#          wire time, so the CPU per byte shows, as on a fast network.
#
# Both bucket sizes shrink with the parameters (mpiddp's 4 MB and DDP's 25 MB defaults times
# the scale), so that a bucket holds the same layers as in the real model: unscaled, DDP's
# one 25 MB bucket would hold the whole shrunken model and overlap nothing.
#
# Compute is a GIL-free wait (scripts/bench/simulated_models.py), so on this machine's 2 cores only
# communication uses the CPU. Then `python scripts/bench/plot_scaling.py OUTPUT_DIR` prints the
# tables and draws docs/img/scaling_efficiency.png.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-scaling-results}"
SETTINGS="${SETTINGS:-light heavy}"
NODES="${NODES:-2 4 8 16}"
REGIMES="${REGIMES:-compute balanced wire}"
MODEL="${MODEL:-sim-resnet50}"
VARIANTS="${VARIANTS:-mpiddp,overlap,native,ddp,single}"
PARTS="${PARTS:-training allreduce}"
ALLREDUCE_SETTINGS="${ALLREDUCE_SETTINGS:-heavy}"
LINK_SCALE="${LINK_SCALE:-1}"
RANKS_PER_NODE="${RANKS_PER_NODE:-1}"
STEPS="${STEPS:-8}"
ITERS="${ITERS:-2}"
CLUSTER="$ROOT/scripts/cluster/local_cluster.sh"
# shellcheck source=../ensure_env.sh
source "$ROOT/scripts/ensure_env.sh"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
CORES="$(getconf _NPROCESSORS_ONLN)"   # not nproc: it obeys OMP_NUM_THREADS
mkdir -p "$OUT"
trap 'bash "$CLUSTER" down >/dev/null 2>&1 || true' EXIT
failed=()

# One launch, its output to NAME.txt (and the terminal); a launch that fails is named at the
# end and the others still run (an hour's runs should not end at the first failure).
launch() {
  local name="$1"; shift
  if ! bash "$CLUSTER" run "$@" 2>&1 | grep -v "c10d\] The hostname" | tee "$name.txt"; then
    echo "### FAILED: $(basename "$name") (output in $name.txt)"
    failed+=("$(basename "$name")")
  fi
}

for setting in $SETTINGS; do
  case "$setting" in
    light) gbit=0.2 scale=0.05 ;;
    heavy) gbit=1 scale=0.25 ;;
    *) echo "unknown setting $setting (light, heavy)" >&2; exit 2 ;;
  esac
  rate="$(python3 -c "print(f'{round($gbit * 1000 * $LINK_SCALE)}mbit')")"
  bash "$CLUSTER" down >/dev/null 2>&1 || true
  bash "$CLUSTER" up 16 "$rate"
  shapes="$NODES"
  # Several ranks per node: the node-local link alone first (1xG), for the all-reduce only.
  [[ "$RANKS_PER_NODE" -gt 1 && "$PARTS" == *allreduce* ]] && shapes="node-local $shapes"
  for nodes in $shapes; do
    train="$PARTS"
    [ "$nodes" = node-local ] && nodes=1 train=""
    shape="${nodes}x${RANKS_PER_NODE}"
    yield=()
    [ "$((nodes * RANKS_PER_NODE))" -gt "$CORES" ] && yield=(-genv MPIR_CVAR_ENABLE_HEAVY_YIELD 1)
    if [[ "$PARTS" == *allreduce* && " $ALLREDUCE_SETTINGS " == *" $setting "* ]]; then
      name="$OUT/allreduce-$setting-$shape"
      echo "### all-reduce, $setting ($rate links), $shape ($(date -u +%T))"
      launch "$name" "$shape" -- "${yield[@]}" \
        python "$ROOT/scripts/bench/benchmark_allreduce.py" --min-size 4K --max-size 64M \
        --seconds 0.5 --json "$name.json"
    fi
    [[ "$train" == *training* ]] || continue
    for regime in $REGIMES; do
      name="$OUT/$setting-$MODEL-$regime-$shape"
      echo "### $setting, $MODEL, $regime, $shape ($(date -u +%T))"
      launch "$name" "$shape" -- "${yield[@]}" \
        python "$ROOT/scripts/bench/synthetic_benchmark.py" --threads 1 --model "$MODEL" \
        --param-scale "$scale" --regime "$regime" --link-gbit "$gbit" \
        --variants "$VARIANTS" --iters "$ITERS" --steps "$STEPS" --warmup 2 \
        --bucket-cap-mb "$(python3 -c "print(4 * $scale)")" \
        --ddp-bucket-mb "$(python3 -c "print(25 * $scale)")" \
        --json "$name.json"
    done
  done
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "### ${#failed[@]} launch(es) failed: ${failed[*]}" >&2
  exit 1
fi
