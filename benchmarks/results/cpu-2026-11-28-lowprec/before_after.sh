#!/bin/bash
# Before/after issue 31's kernels (bucket tables shared with the CUDA kernels, one Philox for scalar and
# 16-lane code, one shared Adam context): bench_lowprec_kernels.py with the CPU kernels of main
# (BEFORE_TREE, a checkout of main with its build) and of this tree, alternating, 2 torch threads, 16M fp32
# params, at nice -10 when allowed (the machine is shared). Nothing is written into BEFORE_TREE.
#   bash benchmarks/results/cpu-2026-11-28-lowprec/before_after.sh BEFORE_TREE [RUNS] [FIRST_RUN]
set -euo pipefail
before=$1
runs=${2:-2}
first=${3:-1}
out=$(dirname "$0")
py=${PYTHON:-$(pwd)/.venv/bin/python}
nice=$(nice -n -10 true 2>/dev/null && echo "nice -n -10" || echo "")
for run in $(seq "$first" $((first + runs - 1))); do
  for which in before after; do
    tree=$([ $which = before ] && echo "$before" || pwd)
    dir="$out/$which-t2-run$run"
    (cd "$tree" && OMP_NUM_THREADS=2 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$tree" $nice $py "$OLDPWD/benchmarks/bench_lowprec_kernels.py" \
      --device cpu --out "$OLDPWD/$dir" --sizes 16M) > "$dir.log" 2>&1
    echo "$which run=$run: $(grep -c 'distopt' "$dir.log") rows"
  done
done
