"""GPU tests of where the ops run and how far they index: tensors on a GPU other than the current one,
and a tensor of more than 2^31 elements (64-bit offsets). Marked ``cuda`` (skipped without a GPU); the
first needs two GPUs, the second enough free memory (checked first: skipped otherwise).

Per-list different misalignments on CUDA are covered by the backend-parametrised scenarios of
test_ops_launches.py (test_adam_per_list_offsets "each_list_its_own" and friends, and
test_l2norm_and_scale_mixed_alignment_within_a_list), which run on "cuda" with a GPU and are checked
bit for bit against the CPU kernel there.
"""

from __future__ import annotations

import math

import pytest
import torch

from distopt import ops

from op_helpers import (
    BF16,
    FP16,
    FP32,
    GRAD_SCALE,
    HYPER,
    NORM_RTOL,
    assert_adam_bits_equal,
    assert_each_bits_equal,
    make_adam_state,
    randn_list,
    run_adam,
    run_adam_capturable,
    run_reference_adam,
    scalar,
)
from tolerances import KERNEL, assert_close

pytestmark = pytest.mark.cuda

BIG = 2**31 + 4099  # elements: past int32 indexing, and not a multiple of the chunk or the vector width


def test_ops_on_a_device_other_than_the_current_one() -> None:
    """Tensors on cuda:1 while cuda:0 is current: every op runs on the tensors' device and its current
    stream, gives the CPU kernel's bits, and leaves the current device as it was."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    sizes = (5, 70_001, 33)
    cpu = make_adam_state(sizes, FP32, BF16, FP16, device="cpu")
    gpu = cpu.to(dev)
    lr, steps = scalar(HYPER["lr"], dev), [scalar(4.0, dev)] * len(sizes)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):  # cuda:1's current stream; cuda:0's stays the default
        run_adam(gpu, step=3, grad_scale=scalar(GRAD_SCALE, dev))
        run_adam_capturable(gpu, lr=lr, steps=steps)
        total, per_tensor = ops.l2norm(gpu.params)
        scaled = randn_list(sizes, BF16, dev)
        ops.scale_(gpu.grads, scaled, scalar(GRAD_SCALE, dev))
    side.synchronize()
    assert torch.cuda.current_device() == 0
    run_adam(cpu, step=3, grad_scale=scalar(GRAD_SCALE, "cpu"))
    run_adam_capturable(cpu, lr=scalar(HYPER["lr"], "cpu"), steps=[scalar(4.0, "cpu")] * len(sizes))
    assert_adam_bits_equal(gpu, cpu)
    cpu_total, cpu_per = ops.l2norm(cpu.params)
    torch.testing.assert_close(per_tensor.cpu(), cpu_per, rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(total.cpu(), cpu_total, rtol=NORM_RTOL, atol=0)
    scale = torch.tensor(GRAD_SCALE, dtype=FP32)
    assert_each_bits_equal([s.cpu() for s in scaled], [(g.float() * scale).to(BF16) for g in cpu.grads], "scaled")


def free_bytes() -> int:
    free, _ = torch.cuda.mem_get_info()
    return free


def sample_indices(n: int, device) -> torch.Tensor:
    """Elements around the 2^31 boundary, the chunk and vector edges at the end, and random ones."""
    edges = torch.tensor([0, 1, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, n - 4099, n - 3, n - 2, n - 1])
    return torch.cat([edges, torch.randint(0, n, (4096,))]).to(device)


def test_adam_and_l2norm_past_2_31_elements() -> None:
    """One tensor of 2^31 + 4099 elements (fp32 params, bf16 grads): the Adam update at sampled elements
    (both sides of 2^31, the tail, random ones) matches the float64 reference run on those elements, and
    the norm matches a float64 sum."""
    need = BIG * (4 + 2 + 4 + 4) + 6 * 2**30  # params, grads, moments; the float64 norm's 2^28-element chunks
    if free_bytes() < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, {free_bytes() / 2**30:.0f} GiB free")
    dev = torch.device("cuda")
    state = make_adam_state([BIG], FP32, BF16, device=dev)
    idx = sample_indices(BIG, dev)
    sample = make_adam_state([idx.numel()], FP32, BF16, device=dev)  # the sampled elements, before the step
    for dst, src in zip(sample.lists()[:4], state.lists()[:4]):
        dst[0].copy_(src[0][idx])
    original = sample.params[0].clone()
    run_adam(state, step=5, grad_scale=scalar(GRAD_SCALE, dev))
    run_reference_adam(sample, step=5, grad_scale=scalar(GRAD_SCALE, dev))  # elementwise: same math per element
    for name in ("params", "exp_avgs", "exp_avg_sqs"):
        got, want = getattr(state, name)[0][idx], getattr(sample, name)[0]
        assert_close(got, want, KERNEL, msg=lambda m, n=name: f"{n} at sampled elements: {m}")
    assert not torch.equal(state.params[0][idx], original)

    total, per_tensor = ops.l2norm(state.grads)
    expected = math.sqrt(sum(float(c.double().square().sum()) for c in state.grads[0].split(2**28)))
    assert math.isclose(per_tensor[0].item(), expected, rel_tol=NORM_RTOL)
    assert math.isclose(total.item(), expected, rel_tol=NORM_RTOL)
