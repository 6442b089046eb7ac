#!/usr/bin/env bash
# The whole GPU suite in one call, under 10 minutes on one H100:
#   device   OUT_DIR/device.txt: GPU, driver, torch/CUDA/nvcc versions, git commit
#   build    pip install --no-build-isolation -e .   (no downloads: the machine has no internet)
#   pytest   python -m pytest -m cuda -v             -> OUT_DIR/pytest_cuda.log
#   lowprec  benchmarks/bench_lowprec_kernels.py --device cuda --torchao (bf16, stochastic bf16 and 8-bit
#            moments vs fp32 moments and torch's fused AdamW, checked against the CPU kernel's bits)
#            -> its table and lowprec_kernels.json in OUT_DIR/suite.log, between "=== ... begin/end" lines
#   bench    benchmarks/bench_kernels.py --device cuda -> OUT_DIR/results.json, results.png
#   step     benchmarks/bench_step.py --device cuda --world-size 1 (whole optimizer step and iteration:
#            DistributedFusedAdam vs FusedAdam vs DDP + AdamW) -> OUT_DIR/results_step.json, .png
#   offload  benchmarks/bench_offload.py --device cuda --params 100M (device bytes per param, step and
#            iteration time, with and without offload_optimizer) -> its table and results_offload.json
#            in OUT_DIR/suite.log, between "=== results_offload.json begin/end" lines (no files left)
#   memcheck compute-sanitizer --tool memcheck on every op and dtype path at small sizes
#   racecheck compute-sanitizer --tool racecheck on the kernels that use shared memory: l2norm's
#            reduction, the capturable Adam's per-block coefficients and the 8-bit maps' bucket tables
#                                                     -> OUT_DIR/sanitizer.log
# Everything is also in OUT_DIR/suite.log; eight files in all, one folder deep (the device returns at
# most 8 files, 2 folders deep: a new output must be merged into an existing file). A failing stage
# does not stop the later ones; the exit status is nonzero if any stage failed. The benchmarks run
# before the sanitizers so that, if the time budget runs short, what is lost is the slowest and least
# essential stage.
#
# Usage: benchmarks/gpu_suite.sh OUT_DIR
# Environment: CUDA_HOME (default /usr/local/cuda), TORCH_CUDA_ARCH_LIST (default 9.0: H100 only, to
# save build time), PYTHON (default python), SUITE_BUDGET_S (default 570: the whole suite's seconds),
# SUITE_PREBUILT=1 (use the modules already in distopt/, see build()).
set -u -o pipefail

OUT=${1:?usage: benchmarks/gpu_suite.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 2

export PYTHONUNBUFFERED=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
PYTHON=${PYTHON:-python}
DEADLINE=$((SECONDS + ${SUITE_BUDGET_S:-570}))
SKIPPED=200  # a stage's "could not run here" status: reported, not a failure
SUMMARY=()
FAILED=0

# run_stage NAME CAP_S FUNCTION: runs FUNCTION with $LIMIT = min(CAP_S, seconds left) and records
# its status and duration.
run_stage() {
  local name=$1 cap=$2 fn=$3 rc=0 start=$SECONDS status
  LIMIT=$((DEADLINE - SECONDS < cap ? DEADLINE - SECONDS : cap))
  if ((LIMIT < 10)); then
    SUMMARY+=("$(printf '%-10s SKIPPED: the suite time budget is spent' "$name")")
    FAILED=1
    return
  fi
  echo
  echo "=== [$name] $(date -u +%H:%M:%S) limit ${LIMIT}s"
  "$fn" || rc=$?
  case $rc in
    0) status=ok ;;
    "$SKIPPED") status="skipped (see above)" ;;
    124 | 137) status="TIMEOUT after ${LIMIT}s"; FAILED=1 ;;
    *) status="FAILED (exit $rc)"; FAILED=1 ;;
  esac
  SUMMARY+=("$(printf '%-10s %-28s %4ss' "$name" "$status" $((SECONDS - start)))")
}

in_time() { timeout --kill-after=15 "$LIMIT" "$@"; }

device_info() {
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "git: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (dirty)')"
    nvidia-smi -L || echo "nvidia-smi not found"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
    "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__,
"cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
    "$CUDA_HOME/bin/nvcc" --version | tail -n 2 || echo "no nvcc in $CUDA_HOME/bin"
    echo "CUDA_HOME=$CUDA_HOME TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
  } 2>&1 | tee "$OUT/device.txt"
}

# --no-deps: torch is already installed and nothing can be downloaded here. With SUITE_PREBUILT=1 the
# modules in distopt/ were built on another machine for this GPU's architecture and came with the tree
# (the build is then a few seconds instead of minutes of the device's time): the stage only checks that
# every op has its CPU and CUDA kernel, and the tree goes on PYTHONPATH for the scripts.
build() {
  if [[ ${SUITE_PREBUILT:-0} == 1 ]]; then
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    in_time "$PYTHON" -c 'from distopt import ops; missing = ops.missing_kernels()
assert not missing, f"prebuilt modules lack {missing}"; print("prebuilt modules load, every kernel there")'
    return
  fi
  in_time "$PYTHON" -m pip install --no-build-isolation --no-deps -v -e .
}

pytest_cuda() { in_time "$PYTHON" -m pytest -m cuda -v 2>&1 | tee "$OUT/pytest_cuda.log"; }

bench() { in_time "$PYTHON" benchmarks/bench_kernels.py --device cuda --out "$OUT"; }

# json_into_log NAME SCRIPT ARGS...: runs benchmarks/SCRIPT --device cuda ARGS --out TMP and prints its
# TMP/NAME between "=== NAME begin/end" lines, so that it lands in suite.log (the device returns at most
# eight files, all taken); its plot is dropped.
json_into_log() {
  local name=$1 script=$2 tmp rc=0
  shift 2
  tmp=$(mktemp -d)
  in_time "$PYTHON" "benchmarks/$script" --device cuda "$@" --out "$tmp" || rc=$?
  if [[ -f $tmp/$name ]]; then
    echo "=== $name begin"
    cat "$tmp/$name"
    echo "=== $name end"
  fi
  rm -rf "$tmp"
  return "$rc"
}

# ~60 s expected: low-precision moments (bf16, stochastic bf16, 8-bit) against fp32 moments and torch's
# fused AdamW, each checked bit for bit against the CPU kernel first.
bench_lowprec() { json_into_log lowprec_kernels.json bench_lowprec_kernels.py --torchao; }

# ~30 s expected (a 98M-param GPT: correctness check in fp32 and bf16, then 4 optimizers timed).
bench_step() { in_time "$PYTHON" benchmarks/bench_step.py --device cuda --world-size 1 --out "$OUT"; }

# ~60 s expected (4 pairs of a 100M-param Linear stack; the offloaded steps run the host kernel over
# 1.6 GB of state).
bench_offload() { json_into_log results_offload.json bench_offload.py --params 100000000; }

# Every op and dtype path at small sizes, low-precision moments too: odd lengths, one tensor spanning
# several chunks, more tensors than one launch's metadata holds, and views at an odd element offset so
# that both the vectorised and the unaligned paths run. Inputs are made on the host so that few torch kernels run
# under the (slow) sanitizer. No value checks: the tests do those; this looks for memory errors.
read -r -d '' SANITIZER_PY <<'EOF'
import sys
import torch
from distopt import ops
from distopt.reference import split_bf16_remainder
from distopt.state_formats import quantize_blockwise

OPS = ("adam_step_", "l2norm", "scale_", "cast_copy_")
assert all(ops.has_kernel(op, "cuda") for op in OPS), "distopt._C has no CUDA kernels"
torch.manual_seed(0)
SIZES = [1, 3, 17, 4099, 70001] + [33] * 150

def place(host_tensors, k=0):
    """Copies to the GPU (no kernels), every other tensor at an odd element offset."""
    out = []
    for i, t in enumerate(host_tensors):
        off = (i + k) % 2
        buf = torch.empty(t.numel() + off, dtype=t.dtype, device="cuda")
        buf[off:].copy_(t)
        out.append(buf[off:])
    return out

def make(dtype, k=0):
    return place([torch.randn(n).to(dtype) for n in SIZES], k)

def scalar(x):
    return torch.full((1,), x, device="cuda")

def adam(param, grad, out, remainder=False, adam_w=True, capturable=False):
    if remainder:
        his, los = zip(*(split_bf16_remainder(torch.randn(n)) for n in SIZES))
        params, rems = place(his), place(los, 1)
    else:
        params, rems = make(param), []
    exp_avg_sqs = place([torch.rand(n) for n in SIZES], 1)
    args = (params, make(grad, 1), make(torch.float32), exp_avg_sqs)
    kw = dict(param_outs=make(out, 1) if out else (), param_remainders=rems, weight_decay=0.01,
              adam_w_mode=adam_w, grad_scale=scalar(0.5), found_inf=scalar(0.0))
    if capturable:
        ops.adam_step_(*args, lr=scalar(1e-3), step=[scalar(3.0)] * len(SIZES), **kw)
    else:
        ops.adam_step_(*args, lr=1e-3, step=3, **kw)

def l2norm():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensors = make(dtype)
        tensors[3][5] = float("inf")
        found_inf = scalar(0.0)
        ops.l2norm(tensors, found_inf)
        assert found_inf.item() == 1.0

l2norm()
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
def lowprec(param, moments, seed, capturable=False):
    """Low-precision moments (bf16 or 8-bit codes with float32 absmax per 256), stochastic rounding with a seed;
    capturable: lr and steps as device tensors (the per-block coefficients in shared memory)."""
    if moments is torch.uint8:
        (m, ms), (v, vs) = (zip(*(quantize_blockwise(x(n), s) for n in SIZES)) for x, s in ((torch.randn, True), (torch.rand, False)))
        m, v, scales = place(m), place(v, 1), dict(exp_avg_scales=place(ms, 1), exp_avg_sq_scales=place(vs))
    else:
        m, v, scales = make(moments), place([torch.rand(n).to(moments) for n in SIZES], 1), {}
    seeded = dict(rounding_seed=seed, param_ids=list(range(len(SIZES)))) if seed is not None else {}
    when = dict(lr=scalar(1e-3), step=[scalar(3.0)] * len(SIZES)) if capturable else dict(lr=1e-3, step=3)
    ops.adam_step_(make(param), make(param, 1), m, v, weight_decay=0.01, grad_scale=scalar(0.5),
                   found_inf=scalar(0.0), **when, **scales, **seeded)

adam(f32, bf16, bf16, capturable=True)  # its coefficients go through shared memory
lowprec(f32, torch.uint8, None, capturable=True)  # so do the 8-bit maps' bucket tables, and its coefficients
if sys.argv[1:] != ["shared"]:
    lowprec(f32, bf16, None)
    lowprec(bf16, bf16, 7)
    lowprec(f32, torch.uint8, None)
    lowprec(bf16, torch.uint8, 7)
    lowprec(bf16, bf16, 7, capturable=True)
    adam(f32, f32, None)
    adam(f32, bf16, bf16)
    adam(f32, f16, f16, adam_w=False)
    adam(bf16, bf16, None, remainder=True)
    adam(f32, f32, bf16, capturable=True)
    adam(f16, f16, None)
    for src, dst in ((f32, bf16), (f16, f32), (bf16, bf16)):
        ops.scale_(make(src), make(dst, 1), scalar(0.25), scalar(0.0))
        ops.cast_copy_(make(src), make(dst, 1), scalar(0.0))
torch.cuda.synchronize()
print("sanitizer workload done")
EOF

find_sanitizer() {
  if [[ -x $CUDA_HOME/bin/compute-sanitizer ]]; then
    echo "$CUDA_HOME/bin/compute-sanitizer"
  else
    command -v compute-sanitizer
  fi
}

# sanitize TOOL [ARGS...]: the workload under compute-sanitizer --tool TOOL.
sanitize() {
  local tool=$1 cs
  shift
  if ! cs=$(find_sanitizer); then
    echo "compute-sanitizer not found (neither $CUDA_HOME/bin nor PATH): $tool skipped" | tee -a "$OUT/sanitizer.log"
    return "$SKIPPED"
  fi
  echo "=== $tool: $cs" >>"$OUT/sanitizer.log"
  # Without the caching allocator every tensor is its own allocation, so memcheck sees an access
  # past a tensor's end instead of it landing silently in a neighbour inside one cached block.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 in_time "$cs" --tool "$tool" --error-exitcode 99 \
    "$PYTHON" -c "$SANITIZER_PY" "$@" 2>&1 | tee -a "$OUT/sanitizer.log"
}
memcheck() { sanitize memcheck; }
racecheck() { sanitize racecheck shared; }

main() {
  echo "distopt GPU suite: $(date -u +%Y-%m-%dT%H:%M:%SZ), output in $OUT"
  run_stage device 60 device_info
  # 234 s on the H200 of 2026-11-26 (MAX_JOBS=16), the low-precision kernels the long poles: room for
  # their rewrite's per-format loop versions. The suite's deadline still bounds the stages after it.
  run_stage build 330 build
  run_stage pytest 300 pytest_cuda
  run_stage lowprec 90 bench_lowprec
  run_stage bench 150 bench
  run_stage step 120 bench_step
  run_stage offload 100 bench_offload
  run_stage memcheck 90 memcheck
  run_stage racecheck 60 racecheck
  echo
  echo "=== summary ($SECONDS s in all)"
  printf '%s\n' "${SUMMARY[@]}"
  ((FAILED == 0)) && echo "suite: PASSED" || echo "suite: FAILED"
  return "$FAILED"
}

main 2>&1 | tee "$OUT/suite.log"
