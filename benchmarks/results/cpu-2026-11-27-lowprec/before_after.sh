#!/bin/bash
# Before/after the merged CPU low-precision loops (VBMI 8-bit read, bf16 moments in the Adam loop,
# 16-lane Philox): bench_lowprec_kernels.py with the kernels of 396f3e0 (BEFORE_TREE, a build of that
# commit) and of this tree, alternating, at 1 and 2 torch threads, 16M fp32 params.
#   bash benchmarks/results/cpu-2026-11-27-lowprec/before_after.sh BEFORE_TREE
set -euo pipefail
before=$1
out=$(dirname "$0")
py=${PYTHON:-$(pwd)/.venv/bin/python}
for threads in 1 2; do
  for run in 1 2; do
    for which in before after; do
      tree=$([ $which = before ] && echo "$before" || pwd)
      dir="$out/$which-t$threads-run$run"
      (cd "$tree" && OMP_NUM_THREADS=$threads PYTHONPATH="$tree" $py "$OLDPWD/benchmarks/bench_lowprec_kernels.py" \
        --device cpu --out "$OLDPWD/$dir" --sizes 16M) > "$dir.log" 2>&1
      echo "$which threads=$threads run=$run: $(grep -c '=' "$dir.log") lines"
    done
  done
done
