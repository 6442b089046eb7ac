"""BMUF's errors for misuse, on 2 gloo ranks: bad options, nested wrappers, an offloading local
optimizer, ranks that disagree (on options, on their place in the block, on their starting params),
refused loads (which change nothing), params added behind its back; and torch's optimizer hooks
firing on it as on any optimizer."""

from __future__ import annotations

import copy

import pytest
import torch

from distopt import BMUF, FusedAdam

from harness import run_ranks
from test_bmuf import Cfg, make_params


def misuse(rank: int, world: int) -> dict[str, str]:
    """Each misuse, on every rank; returns the messages."""
    msgs = {}

    def expect(name, exc, fn):
        with pytest.raises(exc) as info:
            fn()
        msgs[name] = str(info.value)

    params = make_params(Cfg(), rank, torch.float64)
    sgd = torch.optim.SGD(params, lr=0.1)
    expect("not an optimizer", TypeError, lambda: BMUF(params))
    expect("nested", TypeError, lambda: BMUF(BMUF(sgd, sync_every=2)))
    bad = [dict(sync_every=0), dict(sync_every=1.5), dict(warmup_steps=-1), dict(block_momentum=1.0)]
    for kw in bad + [dict(block_lr=0.0), dict(block_lr=float("nan")), dict(bucket_cap_mb=0)]:
        expect(str(kw), ValueError, lambda kw=kw: BMUF(sgd, **kw))
    two_devices = [torch.zeros(3, requires_grad=True), torch.zeros(3, device="meta", requires_grad=True)]
    expect("devices", ValueError, lambda: BMUF(torch.optim.SGD(two_devices, lr=0.1)))
    expect("ranks disagree", ValueError, lambda: BMUF(sgd, sync_every=2 + rank))
    offloaded = FusedAdam([torch.zeros(3, requires_grad=True)], offload_optimizer=True)
    expect("offload", ValueError, lambda: BMUF(offloaded, sync_every=2))

    # torch's optimizer hooks fire on BMUF as on any optimizer
    calls = []
    hooked = BMUF(torch.optim.SGD(params, lr=0.1), sync_every=3)
    for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre"):
        getattr(hooked, f"register_{kind}_hook")(lambda *args, kind=kind: calls.append(kind))
    hooked.register_load_state_dict_post_hook(lambda opt: calls.append("load_state_dict_post"))
    hooked.step()
    hooked.load_state_dict(hooked.state_dict())
    assert calls == [
        "step_pre",
        "step_post",
        "state_dict_pre",
        "state_dict_post",
        "load_state_dict_pre",
        "load_state_dict_post",
    ]

    # ranks resumed from different blocks: both reach a sync at their 2nd call, at steps 2 and 4
    bmuf = BMUF(torch.optim.SGD(params, lr=0.1), sync_every=2)
    sd = copy.deepcopy(bmuf.state_dict())
    sd["bmuf"]["steps"] = 2 * rank
    bmuf.load_state_dict(sd)
    for p in params:
        p.grad = torch.ones_like(p)
    bmuf.step()
    expect("steps", RuntimeError, bmuf.step)
    assert all(torch.equal(g, s) for g, s in zip(bmuf.state_dict()["bmuf"]["global"], sd["bmuf"]["global"]))

    # loads that fail change nothing
    good = copy.deepcopy(bmuf.state_dict())
    for name, edit in (
        ("world size", lambda d: d["bmuf"].update(world_size=3)),
        ("shape", lambda d: d["bmuf"]["global"].__setitem__(0, torch.zeros(2))),
        ("not bmuf", lambda d: d.pop("bmuf")),
        ("inner", lambda d: d["param_groups"].pop()),
    ):
        bad = copy.deepcopy(good)
        edit(bad)
        expect(f"load {name}", ValueError, lambda bad=bad: bmuf.load_state_dict(bad))
        now = bmuf.state_dict()
        assert now["bmuf"]["steps"] == good["bmuf"]["steps"]
        assert all(torch.equal(a, b) for a, b in zip(now["bmuf"]["global"], good["bmuf"]["global"]))

    # params added behind BMUF's back; ranks that start from different params (no warm-up to fix it)
    bmuf.optimizer.add_param_group({"params": [torch.zeros(2, dtype=torch.float64, requires_grad=True)]})
    expect("params changed", RuntimeError, bmuf.step)
    differ = make_params(Cfg(warmup_steps=1), rank, torch.float64)  # rank-dependent values
    bmuf = BMUF(torch.optim.SGD(differ, lr=0.1), sync_every=1)
    expect("start apart", RuntimeError, bmuf.step)
    return msgs


def test_misuse_gets_clear_errors():
    msgs = run_ranks(misuse, 2)[0]
    assert "sync_every must be an integer >= 1" in msgs["{'sync_every': 0}"]
    assert "block_momentum must be in [0, 1)" in msgs["{'block_momentum': 1.0}"]
    assert "one device" in msgs["devices"]
    assert "local torch.optim.Optimizer" in msgs["not an optimizer"] and "already" in msgs["nested"]
    assert msgs["ranks disagree"].startswith("BMUF: the ranks disagree on sync_every: rank 0 has 2, rank 1 has 3")
    assert "DistributedFusedAdam" not in msgs["ranks disagree"]
    assert "different steps at this sync (2 to 4)" in msgs["steps"]
    assert "saved under 3 ranks, loading under 2" in msgs["load world size"]
    assert "must be a float tensor of shape (7, 5)" in msgs["load shape"]
    assert "no 'bmuf' entry" in msgs["load not bmuf"]
    assert "parameter groups" in msgs["load inner"]
    assert "params changed after BMUF was built" in msgs["params changed"]
    assert "global model copies differ" in msgs["start apart"]
    assert "offload_optimizer=True" in msgs["offload"]
