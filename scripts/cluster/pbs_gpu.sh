#!/bin/bash
# PBS Pro / OpenPBS job: data-parallel training with mpiddp on GPU nodes, one rank per GPU.
#
#   qsub scripts/cluster/pbs_gpu.sh                                       # 2 nodes x 4 GPUs
#   qsub -v TRAIN_ARGS="train.py --epochs 90" scripts/cluster/pbs_gpu.sh  # your script, arguments
#
# With no TRAIN_ARGS it runs examples/getting_started.py. Adapt the #PBS lines (ngpus and
# mpiprocs must be equal) and the environment block to your site (docs/running.md). Every rank
# sees its node's GPUs and mpiddp makes GPU <local rank> current. Untested: no PBS server runs
# on the development machine; the launch rules are those of scripts/cluster/pbs.sh.
#PBS -N mpiddp-gpu
#PBS -l select=2:ncpus=32:ngpus=4:mpiprocs=4
#PBS -l walltime=01:00:00
#PBS -j oe
#PBS -r y
set -euo pipefail

# ---- environment (site specific) ----------------------------------------------------------
#   module load openmpi/cuda       (the CUDA-aware MPI mpi4py was built against)
#   source /path/to/venv/bin/activate
if [ -n "${MPIDDP_VENV:-}" ]; then source "$MPIDDP_VENV/bin/activate"; fi
cd "${PBS_O_WORKDIR:-.}"
NP=$(wc -l < "${PBS_NODEFILE:?not running under PBS}")        # one line per MPI rank
NODES=$(sort -u "$PBS_NODEFILE" | wc -l)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
echo "job ${PBS_JOBID:-?}: $NODES node(s), $NP rank(s)"
python -c "
import mpiddp
from mpi4py import MPI
print(MPI.Get_library_version().splitlines()[0])
print('CUDA-aware MPI:', 'yes' if mpiddp.mpi_cuda_aware() else
      'no: GPU buffers are staged through host memory (docs/gpu.md)')"

# The mpiexec of the MPI mpi4py was built against (see scripts/cluster/pbs.sh for the host file and
# variable-forwarding options of each MPI family).
status=0
# shellcheck disable=SC2086
mpiexec -n "$NP" python ${TRAIN_ARGS:-examples/getting_started.py \
    --checkpoint checkpoints/${PBS_JOBNAME:-mpiddp-gpu}.pt} || status=$?
if [ "$status" -eq 75 ]; then
    echo "job ${PBS_JOBID:-?}: checkpoint written after a stop signal; submitting it again"
    qsub -v TRAIN_ARGS="${TRAIN_ARGS:-}" "${PBS_O_WORKDIR:-.}/scripts/cluster/pbs_gpu.sh"
    exit 0
fi
exit "$status"
