"""One tensor's fused Adam update, timed alone, for `perf record` (README.md here).

    OMP_NUM_THREADS=1 perf record python profile_8bit.py {f32,bf16,u8} NUMEL REPS
"""

import sys
import time

import torch

from distopt import moment_formats as mf
from distopt import ops

torch.manual_seed(0)
fmt, n, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
p, g = torch.randn(n), torch.randn(n) * 1e-2
if fmt == "u8":
    m, ms = mf.from_float32(torch.randn(n) * 1e-3, torch.uint8, True)
    v, vs = mf.from_float32(torch.rand(n) * 1e-6, torch.uint8, False)
    kw = dict(exp_avg_scales=[ms], exp_avg_sq_scales=[vs])
elif fmt == "bf16":
    m, v, kw = (torch.randn(n) * 1e-3).bfloat16(), (torch.rand(n) * 1e-6).bfloat16(), {}
else:
    m, v, kw = torch.randn(n) * 1e-3, torch.rand(n) * 1e-6, {}
times = []
for i in range(reps):
    t = time.perf_counter()
    ops.adam_step_([p], [g], [m], [v], lr=1e-3, step=i + 1, **kw)
    times.append(time.perf_counter() - t)
times.sort()
print(fmt, n, f"{times[len(times) // 2] / n * 1e9:.3f} ns/elem (median), best {times[0] / n * 1e9:.3f}")
