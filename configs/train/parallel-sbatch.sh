#!/usr/bin/env bash
# Data-parallel pre-training under Slurm (docs/parallel.md): one pollen rank per task, 2 nodes x
# 4 ranks. The run folder, data and binary must be on a filesystem every node sees.
#   sbatch configs/train/parallel-sbatch.sh RUN.toml [--set key=value ...]
# (options after RUN.toml go to pollen train, in this job and in the jobs it resubmits)
#SBATCH --job-name=pollen-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@120
#SBATCH --output=pollen-train-%j.log
set -uo pipefail
config=${1:?usage: sbatch parallel-sbatch.sh RUN.toml [--set key=value ...]}
shift
pollen=${POLLEN:-pollen}

# Each rank uses its task's CPUs; --resume starts at step 0 when there is no checkpoint yet.
# --signal above: Slurm sends TERM to every rank 120 s before the time limit.
srun --mpi=pmix --cpu-bind=none "$pollen" train --config "$config" \
  --set run.threads="${SLURM_CPUS_PER_TASK:-0}" "$@" --resume &
wait $!
status=$?
# 3: preempted (a checkpoint was written), 4: a rank died or hung: continue in a new job of
# this job's shape (sbatch would otherwise read the #SBATCH lines above again and drop the
# options this job was submitted with). A failure that repeats (a bad node, parallel.timeout_s
# shorter than a checkpoint's write) would resubmit forever: the jobs count their exit-4
# resubmissions in a row in POLLEN_FAILED_RESUBMITS (a preemption starts the count again) and
# stop after the third.
max_failed_resubmits=3
failed=${POLLEN_FAILED_RESUBMITS:-0}
if [ "$status" -eq 3 ]; then
  failed=0
elif [ "$status" -eq 4 ]; then
  failed=$((failed + 1))
fi
if [ "$status" -eq 4 ] && [ "$failed" -gt "$max_failed_resubmits" ]; then
  echo "parallel-sbatch.sh: exit code 4 (a rank died or hung) again after $max_failed_resubmits" \
    "resubmissions in a row; not resubmitting. Find the cause (the error above names the rank)," \
    "then sbatch this script again: the run resumes from its last checkpoint" >&2
elif [ "$status" -eq 3 ] || [ "$status" -eq 4 ]; then
  sbatch --export=ALL,POLLEN_FAILED_RESUBMITS="$failed" --nodes="$SLURM_JOB_NUM_NODES" \
    --ntasks="$SLURM_NTASKS" --ntasks-per-node="$SLURM_NTASKS_PER_NODE" \
    --cpus-per-task="$SLURM_CPUS_PER_TASK" "$0" "$config" "$@"
fi
exit "$status"
