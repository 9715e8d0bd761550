#!/bin/bash
# PBS Pro / OpenPBS / Torque job: data-parallel training with mpiddp on 2 nodes x 8 ranks.
#
#   qsub scripts/cluster/pbs.sh                              # submit from the repository root
#   qsub -v TRAIN_ARGS="--epochs 30" scripts/cluster/pbs.sh  # arguments for train.py
#
# Adapt the #PBS lines and the environment block to your site (docs/running.md, "Batch
# scripts"). The job resumes from its checkpoint when it is rerun.
#PBS -N mpiddp-train
#PBS -l select=2:ncpus=32:mpiprocs=8
#PBS -l walltime=00:30:00
#PBS -j oe
#PBS -r y
set -euo pipefail

# ---- environment (site specific) ----------------------------------------------------------
#   module load openmpi        (the MPI mpi4py was built against)
#   source /path/to/venv/bin/activate
if [ -n "${MPIDDP_VENV:-}" ]; then source "$MPIDDP_VENV/bin/activate"; fi
cd "${PBS_O_WORKDIR:-.}"
NP=$(wc -l < "${PBS_NODEFILE:?not running under PBS}")        # one line per MPI rank
NODES=$(sort -u "$PBS_NODEFILE" | wc -l)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"                # cores per rank
echo "job ${PBS_JOBID:-?}: $NODES node(s), $NP rank(s)"
python -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"

# The launch rule is the one of scripts/cluster/slurm.sbatch: the mpiexec must be the one of the MPI
# library mpi4py was built against (after the module load above, `which mpiexec` is); another
# MPI's mpiexec starts N one-process MPI jobs, and mpiddp.init() stops them all with a
# LaunchError. PBS-integrated MPIs read the node file themselves; otherwise pass it: Open MPI
# --hostfile "$PBS_NODEFILE", MPICH/Intel MPI (the bundled MPICH wheel's mpiexec too, which
# reaches the other nodes by ssh) -f "$PBS_NODEFILE". Open MPI also needs -x OMP_NUM_THREADS
# (and -x for any MPIDDP_* setting) to forward variables.
# Unlike the Slurm script (tests/test_slurm.py), this one is untested: no PBS server can run on
# the development machine.
# Preemption: PBS sends SIGTERM before it kills a job; train.py stops every rank at the same
# step, writes an exact checkpoint and exits 75 (the same protocol as the Slurm script), and
# this script submits the job again, to resume from the checkpoint. Forward SIGTERM to the
# ranks if your mpiexec does not (hydra and Open MPI do).
status=0
# shellcheck disable=SC2086
mpiexec -n "$NP" python scripts/train.py \
    --checkpoint "checkpoints/${PBS_JOBNAME:-mpiddp-train}.pt" --resume ${TRAIN_ARGS:-} \
    || status=$?
if [ "$status" -eq 75 ]; then
    echo "job ${PBS_JOBID:-?}: checkpoint written after a stop signal; submitting it again"
    # (not $0: a spool copy)
    qsub -v TRAIN_ARGS="${TRAIN_ARGS:-}" "${PBS_O_WORKDIR:-.}/scripts/cluster/pbs.sh"
    exit 0
fi
exit "$status"
