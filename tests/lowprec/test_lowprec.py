"""DistributedFusedAdam's low-precision moments are sharding-invariant: bit for bit FusedAdam's.

When every rank computes the same gradient (averaging over 1, 2 or 4 ranks is then exact), the
sharded update must store the same bits as FusedAdam on whole params: params, bf16 moments, 8-bit
codes and absmax scales, for every format combination, with and without stochastic rounding, for
params straddling 256-element blocks, buckets and shards, at several bucket sizes. A skipped
(inf/nan) step changes no byte. The negative control plans the layout without the 256-element
alignment of 8-bit buckets: blocks then straddle shards and the bits must differ.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from distopt import DistributedFusedAdam, FusedAdam
from distopt import moment_formats as mf
from distopt.distributed import moments as moments_module
from distopt.moment_formats import ABSMAX_KEYS

from harness import run_ranks

F32, BF16, U8 = torch.float32, torch.bfloat16, torch.uint8
# Odd sizes straddling blocks and buckets; 300 and 1000 stay fp32 (under 4,096 elements globally).
SHAPES = [(5003,), (300,), (67, 71), (1000,), (4099,)]
FORMATS = [(m, v, sr) for m, v in itertools.product((F32, BF16, U8), repeat=2) if (m, v) != (F32, F32)
           for sr in (False, True) if not sr or BF16 in (m, v)]
BUCKET_MB = (0.01, 0.03, 100.0)  # splits params over buckets; several params per bucket; one bucket
STEPS = 3


def make_params(dtype: torch.dtype = F32) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]


def grads(step: int, params: list[torch.Tensor], inf_at: int | None) -> list[torch.Tensor]:
    """The same grads on every rank; with `inf_at` == step one of them holds an inf."""
    g = torch.Generator().manual_seed(100 + step)
    out = [(torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-3, 2, (), generator=g)).to(p.dtype)
           for p in params]
    if inf_at == step:
        out[2][3, 5] = float("inf")
    return out


def backward(params, grads) -> None:
    """A backward pass whose grads are exactly `grads` (DistributedFusedAdam takes them from its hooks)."""
    sum((p * g).sum() for p, g in zip(params, grads)).backward()


def run_steps(opt: torch.optim.Optimizer, params, steps: range) -> None:
    """The optimizer steps `steps` (numbered: each has its own grads)."""
    for step in steps:
        opt.zero_grad()
        backward(params, grads(step, params, None))
        opt.step()


def options(formats, param_dtype: torch.dtype) -> dict:
    m, v, sr = formats
    extra = {"store_params": False} if param_dtype == BF16 else {}
    return dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=m, exp_avg_sq_dtype=v, stochastic_rounding=sr, **extra)


def fused_adam(formats, param_dtype: torch.dtype, inf_at: int | None = None) -> dict:
    """FusedAdam's params and state after the steps (the reference)."""
    params = make_params(param_dtype)
    opt_kwargs = options(formats, param_dtype)
    opt_kwargs.pop("store_params", None)
    torch.manual_seed(1)  # the rounding seed is drawn here, as on every rank below
    opt = FusedAdam(params, **opt_kwargs)
    for step in range(STEPS):
        opt.zero_grad()
        backward(params, grads(step, params, inf_at))
        if inf_at is not None:
            opt.unscale_grads(inv_scale=1.0)  # the inf/nan check runs
        opt.step()
    return {"params": [p.detach().clone() for p in params],
            "state": [{k: v.clone() for k, v in opt.state[p].items() if k != "step"} for p in params]}


def dfa_rank(rank: int, world_size: int, formats, param_dtype: torch.dtype, bucket_mb: float,
             inf_at: int | None, misalign: bool, extra: dict) -> dict:
    params = make_params(param_dtype)
    if misalign:  # the negative control: 8-bit buckets laid out with the fp32 alignment
        moments_module.ShardMoments.aligns = lambda self, keys: {}
    torch.manual_seed(1)
    opt = DistributedFusedAdam(params, bucket_cap_mb=bucket_mb, **options(formats, param_dtype), **extra)
    before = None
    for step in range(STEPS):
        opt.zero_grad()
        backward(params, grads(step, params, inf_at))
        if inf_at is not None:
            opt.unscale_grads(inv_scale=1.0)
            if step == inf_at:
                before = snapshot(opt, params)
        opt.step()
        if step == inf_at:
            assert snapshot(opt, params) == before, "a skipped step changed a byte"
    # This rank's fragments of each state tensor, as raw bytes, with where they belong in the param.
    pieces = []
    for b in opt.shard_buckets():
        s = b.state
        for f in b.fragments:
            part = {"exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq, "param": s.master}
            entry = {k: t[f.shard_offset : f.shard_offset + f.numel].clone() for k, t in part.items() if t is not None}
            for name, scales in (("exp_avg", s.exp_avg_scales), ("exp_avg_sq", s.exp_avg_sq_scales)):
                if scales is not None:
                    first = f.shard_offset // 256
                    entry[ABSMAX_KEYS[name]] = scales[first : first + -(-f.numel // 256)].clone()
            pieces.append((f.param, f.param_offset, entry))
    return {"params": [p.detach().clone() for p in params], "pieces": pieces}


def snapshot(opt: DistributedFusedAdam, params) -> list[bytes]:
    """Every byte of this rank's state and the params."""
    out = [p.detach().view(-1).view(torch.uint8).numpy().tobytes() for p in params]
    for b in opt.shard_buckets():
        s = b.state
        for t in (s.exp_avg, s.exp_avg_sq, s.exp_avg_scales, s.exp_avg_sq_scales, s.master):
            if t is not None:
                out.append(t.view(torch.uint8).numpy().tobytes())
    return out


def assemble(results: list[dict], reference: dict) -> list[dict]:
    """Each param's state put together from every rank's fragments (shaped as the reference's, flat)."""
    whole = [{k: torch.full((v.numel(),), float("nan")).to(v.dtype) for k, v in st.items()}
             for st in reference["state"]]
    for r in results:
        for param, offset, entry in r["pieces"]:
            for k, t in entry.items():
                if k == "param":
                    continue
                if k in ABSMAX_KEYS.values():
                    whole[param][k][offset // 256 : offset // 256 + t.numel()] = t
                else:
                    whole[param][k][offset : offset + t.numel()] = t
    return whole


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def check_identical(formats, param_dtype=F32, bucket_mb=0.01, world_sizes=(1, 2, 4), inf_at=None,
                    misalign=False, extra=None) -> None:
    reference = fused_adam(formats, param_dtype, inf_at)
    for world_size in world_sizes:
        results = run_ranks(dfa_rank, world_size, (formats, param_dtype, bucket_mb, inf_at, misalign, extra or {}))
        for r in results:
            for i, (p, q) in enumerate(zip(r["params"], reference["params"])):
                assert same_bits(p, q), f"world size {world_size}: param {i} differs from FusedAdam's"
        for i, (got, want) in enumerate(zip(assemble(results, reference), reference["state"])):
            for k, v in want.items():
                assert same_bits(got[k], v.reshape(-1)), f"world size {world_size}: {k} of param {i} differs"


@pytest.mark.parametrize("formats", FORMATS, ids=lambda f: f"{f[0]}-{f[1]}-sr{int(f[2])}".replace("torch.", ""))
def test_bit_identical_to_fused_adam_at_every_world_size(formats):
    bucket_mb = BUCKET_MB[FORMATS.index(formats) % len(BUCKET_MB)]  # each bucket size over the formats
    check_identical(formats, bucket_mb=bucket_mb)


@pytest.mark.slow
@pytest.mark.parametrize("bucket_mb", BUCKET_MB)
@pytest.mark.parametrize("formats", FORMATS, ids=lambda f: f"{f[0]}-{f[1]}-sr{int(f[2])}".replace("torch.", ""))
def test_bit_identical_every_format_and_bucket_size(formats, bucket_mb):
    check_identical(formats, bucket_mb=bucket_mb)


def test_bf16_params_round_stochastically_as_fused_adam():
    """bf16 params without masters (store_params=False) and bf16 moments, rounded stochastically."""
    check_identical((U8, BF16, True), param_dtype=BF16, bucket_mb=0.01)


@pytest.mark.parametrize("extra", [dict(contiguous_grad_buffer=True, contiguous_param_buffer=True),
                                   dict(store_params=True)], ids=["contiguous", "masters"])
def test_bit_identical_with_buffer_options(extra):
    check_identical((U8, BF16, True), bucket_mb=0.01, world_sizes=(1, 2), extra=extra)


def test_a_skipped_step_changes_no_byte():
    check_identical((U8, BF16, True), bucket_mb=0.01, world_sizes=(1, 2), inf_at=1)


def test_negative_control_blocks_straddling_shards_break_identity():
    with pytest.raises(AssertionError, match="differs"):
        check_identical((U8, U8, False), bucket_mb=0.01, world_sizes=(2,), misalign=True)


def seeds(rank: int, world_size: int) -> int:
    params = make_params()
    torch.manual_seed(rank)  # ranks seeded differently: each draws its own rounding seed
    opt = DistributedFusedAdam(params, exp_avg_dtype=BF16, stochastic_rounding=True)
    opt.init_params()
    return opt.param_groups[0]["rounding_seed"]


def test_every_rank_rounds_with_rank_0s_seed():
    torch.manual_seed(0)
    assert run_ranks(seeds, 2) == [torch.randint(0, 2**62, ()).item()] * 2


def construction_errors(rank: int, world_size: int) -> None:
    params = make_params()
    with pytest.raises(ValueError, match="offload_optimizer"):
        DistributedFusedAdam(params, exp_avg_dtype=U8, offload_optimizer=True)
    with pytest.raises(ValueError, match="exp_avg_dtype must be one of"):
        DistributedFusedAdam(params, exp_avg_dtype=torch.float16)
    with pytest.raises(ValueError, match="would change nothing"):
        DistributedFusedAdam(params, exp_avg_dtype=U8, stochastic_rounding=True)


def test_unsupported_combinations_are_clear_errors():
    run_ranks(construction_errors, 1)


def train_dfa(rank, world_size, formats, steps, first, sd=None, bucket_mb=0.01) -> dict:
    """DistributedFusedAdam's steps `first`..`first + steps - 1` (after loading `sd`, if given): its
    params and state dict (on every rank)."""
    params = make_params()
    torch.manual_seed(1 if sd is None else 2)  # a resumed run must round with the saved seed, not its own
    opt = DistributedFusedAdam(params, bucket_cap_mb=bucket_mb, **options(formats, F32))
    if sd is not None:
        # (no_grad: the reference ops' fallback cast_copy_ refuses to write leaf params under autograd)
        with torch.no_grad():
            for p, q in zip(params, sd["params"]):
                p.copy_(q)
            opt.load_state_dict(sd["optim"])
    run_steps(opt, params, range(first, first + steps))
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


def fused_adam_state_dict(formats, steps: int) -> dict:
    params = make_params()
    torch.manual_seed(1)
    opt = FusedAdam(params, **options(formats, F32))
    run_steps(opt, params, range(steps))
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


def assert_same_state(got: dict, want: dict, what: str) -> None:
    for p, q in zip(got["params"], want["params"]):
        assert same_bits(p, q), f"{what}: params differ"
    for key, entry in want["optim"]["state"].items():
        for name, value in entry.items():
            if name not in ("step", "param"):
                assert same_bits(got["optim"]["state"][key][name], value), f"{what}: {name} of param {key} differs"


@pytest.mark.parametrize("formats", [(U8, BF16, True), (U8, U8, False)], ids=["u8-bf16-sr", "u8-u8"])
def test_state_dicts_round_trip_bit_exactly_and_reshard(formats):
    """Saved at 2 ranks (the same bits as FusedAdam's state dict), loaded at 1, 2 and 4 ranks: training
    continues bit for bit as FusedAdam's uninterrupted run."""
    saved = run_ranks(train_dfa, 2, (formats, 2, 0))[0]
    assert_same_state(saved, fused_adam_state_dict(formats, 2), "saved at 2 ranks vs FusedAdam")
    want = fused_adam_state_dict(formats, STEPS + 1)
    for world_size, bucket_mb in ((1, 100.0), (2, 0.03), (4, 0.01)):
        resumed = run_ranks(train_dfa, world_size, (formats, STEPS + 1 - 2, 2, saved, bucket_mb))[0]
        assert_same_state(resumed, want, f"resumed at {world_size} ranks")
    # FusedAdam's state dict loads here, and this one into FusedAdam: the same bits.
    fused = fused_adam_state_dict(formats, 2)
    assert_same_state(run_ranks(train_dfa, 2, (formats, STEPS + 1 - 2, 2, fused))[0], want, "from FusedAdam")


def adamw_round_trip(rank: int, world_size: int, adamw_sd: dict) -> dict:
    params = make_params()
    opt = DistributedFusedAdam(params, bucket_cap_mb=0.01, **options((U8, BF16, False), F32))
    with torch.no_grad():  # (see train_dfa)
        opt.load_state_dict(adamw_sd)
    return opt.state_dict()


def test_adamw_state_loads_quantised_and_exports_to_fp32():
    params = make_params()
    adamw = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    run_steps(adamw, params, range(2))
    sd = run_ranks(adamw_round_trip, 2, (adamw.state_dict(),))[0]
    for i, p in enumerate(params):
        entry = mf.moments_named(sd["state"][i])  # 8-bit codes are saved under their own keys
        for (name, signed), dtype in zip(mf.SIGNED.items(), mf.MomentFormats(U8, BF16).dtypes(p.numel())):
            assert (mf.CODES_KEYS[name] in sd["state"][i]) == (dtype == U8) != (name in sd["state"][i])
            stored, scales = mf.from_float32(adamw.state[p][name].reshape(-1), dtype, signed)
            assert same_bits(entry[name], stored), f"{name} of param {i} not quantised as on load"
            if scales is not None:
                assert same_bits(entry[mf.ABSMAX_KEYS[name]], scales)
    exported = mf.float32_state_dict(sd)
    back = torch.optim.AdamW(make_params())
    back.load_state_dict(exported)  # torch's own AdamW takes it
    for i in range(len(params)):
        for name, signed in mf.SIGNED.items():
            value = exported["state"][i][name]
            assert value.dtype == F32
            entry = mf.moments_named(sd["state"][i])
            assert same_bits(value, mf.layout_to_float32(entry[name], entry.get(mf.ABSMAX_KEYS[name]), signed))


def refused_load(rank: int, world_size: int, sd: dict) -> None:
    params = make_params()
    opt = DistributedFusedAdam(params, exp_avg_dtype=U8, bucket_cap_mb=0.01)
    opt.zero_grad()
    backward(params, grads(0, params, None))
    opt.step()
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match="absmax"), torch.no_grad():
        opt.load_state_dict(sd)
    assert snapshot(opt, params) == before  # the refused load changed nothing


def test_a_refused_load_changes_nothing():
    sd = run_ranks(train_dfa, 2, ((U8, U8, False), 1, 0))[0]["optim"]
    del sd["state"][0]["exp_avg_absmax"]
    run_ranks(refused_load, 2, (sd,))


def memory(rank: int, world_size: int, formats) -> dict:
    param = torch.nn.Parameter(torch.randn(64 * 256 * world_size))  # whole blocks on every rank: no padding
    opt = DistributedFusedAdam([param], exp_avg_dtype=formats[0], exp_avg_sq_dtype=formats[1])
    opt.init_params()
    return opt.memory_report()


@pytest.mark.parametrize("formats, bytes_per_param", [((U8, U8), 2 + 2 * 4 / 256), ((BF16, BF16), 4.0),
                                                      ((F32, F32), 8.0), ((U8, BF16), 3 + 4 / 256)])
def test_memory_report_matches_the_formula(formats, bytes_per_param):
    for world_size in (1, 2):
        for report in run_ranks(memory, world_size, (formats,)):
            assert report["moments"] == bytes_per_param * 64 * 256  # this rank's shard: 64 blocks
