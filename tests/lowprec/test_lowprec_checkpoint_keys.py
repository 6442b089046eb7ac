"""8-bit moments in state dicts and torch.distributed.checkpoint: the codes sit under keys of their own
(``exp_avg_codes``, ``exp_avg_sq_codes``), so a loader that expects values under ``exp_avg`` (an fp32 or
bf16 optimizer, torch.optim.AdamW, DCP's load, which casts what it reads into its template's dtype) stops
with a missing key instead of taking codes 0..255 for moments. bf16 and fp32 moments convert through DCP
as a state dict does. (DistributedFusedAdam: tests/lowprec/test_lowprec.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distopt import FusedAdam
from distopt import moment_formats as mf

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict  # noqa: E402

BF16, U8, F32 = torch.bfloat16, torch.uint8, torch.float32
# DCP's own refusal: "Missing key in checkpoint state_dict: <key>", raised in its load plan (one process:
# as the RuntimeError itself or wrapped in a CheckpointException, a BaseException, depending on the path).
REFUSED = (RuntimeError, CheckpointException)


def trained(make_opt, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # a 4,352-element weight (8-bit when asked) and a 40-element one (fp32)
    m = nn.Sequential(nn.Linear(64, 68), nn.Tanh(), nn.Linear(68, 10))
    opt = make_opt(m.parameters())
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        opt.zero_grad()
        m(torch.randn(8, 64, generator=gen)).square().mean().backward()
        opt.step()
    return m, opt


def dcp_save(m: nn.Module, opt: torch.optim.Optimizer, path) -> None:
    dcp.save({"optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=str(path))


def dcp_load(m: nn.Module, opt: torch.optim.Optimizer, path) -> None:
    target = {"optim": get_optimizer_state_dict(m, opt)}
    dcp.load(target, checkpoint_id=str(path))
    set_optimizer_state_dict(m, opt, target["optim"])


def eight_bit(params):
    return FusedAdam(params, exp_avg_dtype=U8, exp_avg_sq_dtype=U8)


def snapshot(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]


def unchanged(before: list[dict[str, torch.Tensor]], opt: torch.optim.Optimizer) -> bool:
    """Whether `opt`'s state is still `before` (snapshot), key for key and bit for bit."""
    after = snapshot(opt)
    return len(before) == len(after) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(before, after))


def test_state_dicts_hold_codes_under_their_own_keys_and_load_both_forms():
    m, opt = trained(eight_bit)
    w = m[0].weight
    saved = opt.state_dict()["state"][0]
    assert set(saved) == {"step", "exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax"}
    assert torch.equal(saved["exp_avg_codes"], opt.state[w]["exp_avg"])  # the same bits, another name
    assert set(opt.state[w]) == {"step", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"}
    assert "exp_avg" in opt.state_dict()["state"][2]  # a small param's fp32 moments keep their key
    # Both forms load bit for bit: this one, and codes under the moment's key (saved before the codes keys).
    old = opt.state_dict()
    old["state"] = {k: mf.moments_named(e) for k, e in old["state"].items()}
    for sd in (opt.state_dict(), old):
        m2, opt2 = trained(eight_bit, steps=1)
        opt2.load_state_dict(copy.deepcopy(sd))
        for p, q in zip(m.parameters(), m2.parameters()):
            assert opt.state[p].keys() == opt2.state[q].keys()
            assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])


def test_ambiguous_or_mistyped_codes_are_refused_before_anything_changes():
    m, opt = trained(eight_bit)
    before = snapshot(opt)
    both = opt.state_dict()
    both["state"][0] = {**both["state"][0], "exp_avg": torch.zeros_like(m[0].weight)}
    with pytest.raises(ValueError, match="both 'exp_avg' and 'exp_avg_codes'"):
        opt.load_state_dict(both)
    floats = opt.state_dict()
    floats["state"][0] = {**floats["state"][0], "exp_avg_codes": floats["state"][0]["exp_avg_codes"].float()}
    with pytest.raises(ValueError, match="uint8 tensor of 8-bit codes"):
        opt.load_state_dict(floats)
    assert unchanged(before, opt)


@pytest.mark.parametrize("loader", ["FusedAdam fp32", "FusedAdam bf16", "torch AdamW"])
def test_dcp_never_reads_8bit_codes_as_moments(tmp_path, loader, monkeypatch):
    """An 8-bit checkpoint loaded by an optimizer that holds values under ``exp_avg`` stops at DCP's
    missing-key check and changes nothing. Negative control: with the codes under the moment's key, as
    before, DCP casts them into the template and the optimizer silently takes codes for moments."""
    m, opt = trained(eight_bit)
    make = {"FusedAdam fp32": FusedAdam,
            "FusedAdam bf16": lambda ps: FusedAdam(ps, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
            "torch AdamW": torch.optim.AdamW}[loader]
    dcp_save(m, opt, tmp_path / "keyed")
    m2, opt2 = trained(make)
    before = snapshot(opt2)
    with pytest.raises(REFUSED, match=r"Missing key .*weight\.exp_avg"):
        dcp_load(m2, opt2, tmp_path / "keyed")
    assert unchanged(before, opt2)

    monkeypatch.setattr(FusedAdam, "state_dict", torch.optim.Optimizer.state_dict)  # codes under exp_avg
    dcp_save(m, opt, tmp_path / "unkeyed")
    dcp_load(m2, opt2, tmp_path / "unkeyed")
    codes = opt.state[m[0].weight]["exp_avg"]
    assert torch.equal(opt2.state[m2[0].weight]["exp_avg"].float(), codes.float())  # codes taken as values


def test_dcp_refuses_an_fp32_checkpoint_for_8bit_moments(tmp_path):
    m, adamw = trained(torch.optim.AdamW)
    dcp_save(m, adamw, tmp_path)
    m2, opt = trained(eight_bit)
    before = snapshot(opt)
    with pytest.raises(REFUSED, match=r"Missing key .*weight\.exp_avg(_sq)?_codes"):
        dcp_load(m2, opt, tmp_path)
    assert unchanged(before, opt)


@pytest.mark.parametrize("saved, loaded", [(F32, BF16), (BF16, F32)])
def test_dcp_converts_between_fp32_and_bf16_moments_as_a_state_dict_does(tmp_path, saved, loaded):
    def make(dtype):
        return lambda ps: FusedAdam(ps, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)

    m, opt = trained(make(saved))
    dcp_save(m, opt, tmp_path)
    m2, through_dcp = trained(make(loaded), steps=1)
    dcp_load(m2, through_dcp, tmp_path)
    m3, in_memory = trained(make(loaded), steps=1)
    in_memory.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q, r in zip(m.parameters(), m2.parameters(), m3.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert through_dcp.state[q][name].dtype == loaded
            assert torch.equal(through_dcp.state[q][name], in_memory.state[r][name])
            assert torch.equal(through_dcp.state[q][name], opt.state[p][name].to(loaded))
