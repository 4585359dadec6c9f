#!/usr/bin/env bash
# The data-parallel MLP step of bench_train over 2 MPI processes, against the same step on 2
# places of one process and against PyTorch DDP over gloo (2 processes), measured in one run.
#   bash benchmarks/train_mpi.sh BUILD_DIR [steps]
set -euo pipefail
build=${1:?usage: train_mpi.sh BUILD_DIR [steps]}
steps=${2:-10}
here=$(cd "$(dirname "$0")" && pwd)
mpirun=(mpirun --oversubscribe -np 2)
[ "$(id -u)" -eq 0 ] && mpirun+=(--allow-run-as-root)
threads=$("$build/benchmarks/bench_train_mpi" "$steps" | tee /dev/stderr | sed -n 's/.*: \([0-9.]*\) ms.*/\1/p')
mpi=$("${mpirun[@]}" --bind-to core "$build/benchmarks/bench_train_mpi" "$steps" | tee /dev/stderr | sed -n 's/.*: \([0-9.]*\) ms.*/\1/p')
echo "MPI processes / places in one process: $(python3 -c "print(f'{$mpi / $threads:.2f}')") (time ratio; lower is faster)"
if /usr/bin/python3 -c "import torch" 2>/dev/null; then
  ddp=$(/usr/bin/python3 "$here/train_torch.py" --mode ddp --steps "$steps" 2>/dev/null | tee /dev/stderr |
        sed -n 's/^torch ddp gloo 2 procs strong[^:]*: step \([0-9.]*\) ms.*/\1/p' | head -1)
  [ -n "$ddp" ] && echo "PyTorch DDP gloo (2 processes): $ddp ms; pdo over MPI / DDP: $(python3 -c "print(f'{$mpi / $ddp:.2f}')")"
else
  echo "PyTorch DDP: python3-torch is not installed (apt-get install python3-torch), not measured"
fi
