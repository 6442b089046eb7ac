"""One 64M-element Adam update per moment format (fp32, u8: 8-bit, sr: bf16 with stochastic rounding), run three
times, for Nsight Compute: `ncu --launch-skip 2 --launch-count 1 -k regex:multi_tensor python3 tools/probes/ncu_adam_update.py u8`
(benchmarks/results/h200-2026-11-28). Needs a GPU."""
import sys
import torch
from distopt import ops
from distopt.state_formats import quantize_blockwise
n = 64 * 2**20
torch.manual_seed(0)
p, g = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
def run(fmt):
    if fmt == "u8":
        (m, ms), (v, vs) = quantize_blockwise(torch.randn(n, device="cuda"), True), quantize_blockwise(torch.rand(n, device="cuda"), False)
        kw = dict(exp_avg_scales=[ms], exp_avg_sq_scales=[vs])
    elif fmt == "sr":
        m, v, kw = torch.randn(n, device="cuda").bfloat16(), torch.rand(n, device="cuda").bfloat16(), dict(rounding_seed=7, param_ids=[0])
    else:
        m, v, kw = torch.randn(n, device="cuda"), torch.rand(n, device="cuda"), {}
    for i in range(3):
        ops.adam_step_([p], [g], [m], [v], lr=1e-3, step=i + 1, weight_decay=0.01, **kw)
    torch.cuda.synchronize()
for fmt in sys.argv[1:]:
    run(fmt)
