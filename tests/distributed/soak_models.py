"""Scenarios of the randomised soak test (test_soak.py): a seed fully determines one.

A scenario is a world size, a small random model built from a menu of parts, param groups, the
DistributedFusedAdam options and a training recipe (micro-batches and no_sync, clipping, a GradScaler
with an inf injected on one rank at one micro-batch). Everything here is plain data or a pure
function of the scenario, so the parent process can describe a scenario and the ranks rebuild it.

Model parts (forward order is random; creation order is shuffled independently):
  linear   an nn.Linear, bare or inside an nn.Sequential / nn.ModuleDict container
  conv     a Conv2d over the hidden state seen as (C, 2, 2); channels_last on the conv or the model
  plist    an nn.ParameterList whose params the parent's forward reads (``h @ plist[0] + plist[1]``)
  pdict    an nn.ParameterDict read likewise (``F.linear(h, pdict["w"], pdict["b"])``)
  fn       an nn.Linear never called: its weight and bias are used through F.linear
  tied     the embedding's weight used as a hidden projection (``F.linear(h, embed.weight)``); the
           embedding lookup itself is added at the start of forward ("first") or before the head
           ("last", so the functional use comes before the module runs)
  frozen   an nn.Linear with requires_grad False (the whole layer, or only its weight)
  sometimes an nn.Linear used on some (step, micro-batch) iterations, the same on every rank
plus a stem and a head (always), and an optional `unused` nn.Linear forward never calls.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

CL = torch.channels_last
BATCH = 4
TINY_BUCKET_ELEMENTS = (50, 400)  # fp32 elements per bucket when buckets are tiny


@dataclass(frozen=True)
class Scenario:
    seed: int
    world_size: int
    hidden: int
    d_in: int
    d_out: int
    parts: tuple[str, ...]  # forward order
    creation: tuple[str, ...]  # attribute (module) creation order
    containers: dict[str, str] = field(default_factory=dict)  # linear part -> "bare" | "sequential" | "moduledict"
    channels_last: str | None = None  # "conv" | "model" | None (conv weight only then)
    cl_input: bool = False  # the conv input is channels_last too
    tied: str | None = None  # "first" | "last": where the embedding lookup happens
    frozen: str | None = None  # "layer" | "weight"
    unused: bool = False
    sometimes: tuple[tuple[bool, ...], ...] = ()  # [step][micro]: the `sometimes` layer runs
    groups: tuple[tuple[float, float, tuple[float, float]], ...] = ((1e-2, 0.01, (0.9, 0.999)),)  # lr, wd, betas
    group_of: dict[str, int] = field(default_factory=dict)  # param name -> group index
    frozen_in_groups: bool = True  # frozen params are listed in the param groups (and skipped)
    opt: dict = field(default_factory=dict)  # DistributedFusedAdam keyword arguments
    bf16: bool = False
    adam_w_mode: bool = True
    steps: int = 3
    no_sync: tuple[bool, ...] = (False,)  # per micro-batch: inside no_sync() (the last never is)
    clip: float | None = None
    scaler: dict | None = None  # GradScaler keyword arguments
    amp_pattern: int = 1  # README's GradScaler patterns for DistributedFusedAdam (1, 2 or 3)
    inject: tuple[int, int, int] | None = None  # (step, micro, rank): loss *= inf there

    @property
    def micro_batches(self) -> int:
        return len(self.no_sync)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def eps(self) -> float:
        """Adam's eps. bf16 grads reduced in another order can differ by a bf16 rounding of their
        summands, and where the ranks' grads cancel that is a sign flip, which Adam's first step turns
        into a difference of 2 * lr (update = lr * g / (|g| + eps)); eps = 1e-2 bounds the effect of a
        grad difference d to about lr * d / eps, within the bf16 tolerance, while a real bug (a missed
        update of size ~lr) still shows."""
        return 1e-2 if self.bf16 else 1e-8

    @property
    def find_unused(self) -> bool:
        return self.unused or "sometimes" in self.parts

    def describe(self) -> str:
        """One line naming everything that varies."""
        parts = []
        for p in self.parts:
            if p.startswith("linear"):
                p += f"({self.containers[p]})"
            elif p == "conv":
                p += f"(cl={self.channels_last or 'weight'}{',cl_input' if self.cl_input else ''})"
            elif p == "tied":
                p += f"(lookup {self.tied})"
            elif p == "frozen":
                p += f"({self.frozen})"
            parts.append(p)
        o = self.opt
        bucket = f"{round(o['bucket_cap_mb'] * 2**20 / 4)}el" if "bucket_cap_mb" in o else "default"
        flags = [name for name, key in (("ogs", "overlap_grad_sync"), ("ops", "overlap_param_sync"),
                                        ("cgb", "contiguous_grad_buffer"), ("cpb", "contiguous_param_buffer"),
                                        ("remainders", "store_param_remainders"), ("offload", "offload_optimizer"))
                 if o.get(key)]
        opt = f"bucket={bucket} pipe={o['pipeline_size']} " + ("+".join(flags) or "no-overlap")
        recipe = f"micro={''.join('q' if q else 's' for q in self.no_sync)}"
        if self.clip is not None:
            recipe += f" clip={self.clip}"
        if self.scaler is not None:
            inf = "s{}m{}r{}".format(*self.inject) if self.inject else "none"
            recipe += f" scaler(pattern {self.amp_pattern}, inf@{inf})"
        model = f"stem>{'>'.join(parts)}>head" + (" +unused" if self.unused else "")
        return (f"ws={self.world_size} {'bf16' if self.bf16 else 'fp32'}{'' if self.adam_w_mode else ' adam-l2'} "
                f"H={self.hidden} {model} groups={len(self.groups)} [{opt}] {recipe}")


def make_scenario(seed: int, steps: int = 3) -> Scenario:
    """The scenario of `seed` (a pure function of it)."""
    rng = random.Random(seed)
    world_size = rng.choices([1, 2, 3, 4], weights=[2, 5, 2, 3])[0]
    hidden = rng.choice([8, 12, 16])
    parts = [f"linear{i}" for i in range(rng.choice([0, 1, 1, 2]))]
    for name, chance in (("conv", 0.4), ("plist", 0.35), ("pdict", 0.35), ("fn", 0.3), ("tied", 0.35),
                         ("frozen", 0.35), ("sometimes", 0.35)):
        if rng.random() < chance:
            parts.append(name)
    rng.shuffle(parts)
    containers = {p: rng.choice(["bare", "sequential", "moduledict"]) for p in parts if p.startswith("linear")}
    unused = rng.random() < 0.3
    attrs = ["stem", "head", *parts] + (["unused"] if unused else [])
    attrs = ["embed" if a == "tied" else a for a in attrs]
    rng.shuffle(attrs)
    micro = rng.choice([1, 2, 2, 3])
    sometimes = ()
    if "sometimes" in parts:
        flags = [rng.random() < 0.5 for _ in range(steps * micro)]
        if len(set(flags)) == 1:  # used on some iterations and not on others
            flags[rng.randrange(len(flags))] ^= True
        sometimes = tuple(tuple(flags[s * micro:(s + 1) * micro]) for s in range(steps))

    # Param groups: each param (weight and bias separately) goes to a random group; empty ones dropped.
    n_groups = rng.choice([1, 2, 2, 3])
    groups = [(rng.choice([1e-3, 3e-3, 1e-2, 3e-2]), rng.choice([0.0, 0.01, 0.1]),
               rng.choice([(0.9, 0.999), (0.8, 0.99)])) for _ in range(n_groups)]
    names = param_names(hidden, parts, unused)
    raw = {n: rng.randrange(n_groups) for n in names}
    used = sorted(set(raw.values()))
    group_of = {n: used.index(g) for n, g in raw.items()}
    groups = [groups[g] for g in used]

    bf16 = rng.random() < 0.2
    opt = dict(overlap_grad_sync=rng.random() < 0.7, overlap_param_sync=rng.random() < 0.4,
               contiguous_grad_buffer=rng.random() < 0.3, contiguous_param_buffer=rng.random() < 0.3,
               pipeline_size=rng.choice([1, 2, 3]))
    if rng.random() < 0.5:
        opt["bucket_cap_mb"] = rng.randint(*TINY_BUCKET_ELEMENTS) * 4 / 2**20
    if bf16 and rng.random() < 0.5:
        opt["store_param_remainders"] = True
    # Drawn from a generator of its own, so that every earlier seed keeps its scenario otherwise.
    if not opt.get("store_param_remainders") and random.Random(f"offload {seed}").random() < 0.3:
        opt["offload_optimizer"] = True

    no_sync = rng.choice(["all_but_last", "all_but_last", "none", "random"])
    if no_sync == "all_but_last":
        quiet = [True] * (micro - 1) + [False]
    elif no_sync == "none":
        quiet = [False] * micro
    else:
        quiet = [rng.random() < 0.5 for _ in range(micro - 1)] + [False]
    clip = rng.choice([0.05, 0.2, 1.0]) if rng.random() < 0.5 else None
    scaler = inject = None
    amp_pattern = 1
    if rng.random() < 0.4:
        scaler = dict(init_scale=2.0 ** rng.randint(4, 12), growth_factor=2.0, backoff_factor=0.5,
                      growth_interval=rng.randint(1, 3))
        amp_pattern = rng.choice([1, 1, 3] if clip is not None else [1, 2])
        if rng.random() < 0.8:
            inject = (rng.randrange(steps), rng.randrange(micro), rng.randrange(world_size))
    return Scenario(
        seed=seed, world_size=world_size, hidden=hidden, d_in=rng.randint(5, 10), d_out=rng.randint(3, 5),
        parts=tuple(parts), creation=tuple(attrs), containers=containers,
        channels_last=rng.choice(["conv", "model", None]) if "conv" in parts else None,
        cl_input=rng.random() < 0.5, tied=rng.choice(["first", "last"]) if "tied" in parts else None,
        frozen=rng.choice(["layer", "weight"]) if "frozen" in parts else None, unused=unused,
        sometimes=sometimes, groups=tuple(groups), group_of=group_of, frozen_in_groups=rng.random() < 0.5,
        opt=opt, bf16=bf16, adam_w_mode=rng.random() < 0.85, steps=steps, no_sync=tuple(quiet), clip=clip,
        scaler=scaler, amp_pattern=amp_pattern, inject=inject,
    )


def param_names(hidden: int, parts: list[str] | tuple[str, ...], unused: bool) -> list[str]:
    """The params' names, the same whatever the container (names are stable group keys)."""
    names = ["stem.weight", "stem.bias", "head.weight", "head.bias"] + (["unused.weight", "unused.bias"] if unused
                                                                        else [])
    for p in parts:
        attr = "embed" if p == "tied" else p
        suffixes = {"plist": ["0", "1"], "pdict": ["w", "b"], "tied": ["weight"]}.get(p, ["weight", "bias"])
        names += [f"{attr}.{s}" for s in suffixes]
    return names


class SoakNet(nn.Module):
    """The scenario's model; forward(x, tokens, use_sometimes)."""

    def __init__(self, sc: Scenario) -> None:
        super().__init__()
        self.sc = sc
        h = sc.hidden
        for attr in sc.creation:
            if attr == "stem":
                module = nn.Linear(sc.d_in, h)
            elif attr == "head":
                module = nn.Linear(h, sc.d_out)
            elif attr.startswith("linear"):
                lin = nn.Linear(h, h)
                kind = sc.containers[attr]
                module = (lin if kind == "bare" else nn.Sequential(lin, nn.LayerNorm(h, elementwise_affine=False))
                          if kind == "sequential" else nn.ModuleDict({"lin": lin}))
            elif attr == "conv":
                module = nn.Conv2d(h // 4, h // 4, 3, padding=1)
                if sc.channels_last == "conv":
                    module.to(memory_format=CL)
            elif attr == "plist":
                module = nn.ParameterList([nn.Parameter(torch.randn(h, h) / h**0.5), nn.Parameter(torch.randn(h) / 4)])
            elif attr == "pdict":
                module = nn.ParameterDict({"w": nn.Parameter(torch.randn(h, h) / h**0.5),
                                           "b": nn.Parameter(torch.randn(h) / 4)})
            elif attr == "embed":
                module = nn.Embedding(h, h)
                module.weight.data.div_(h**0.5)
            elif attr in ("fn", "frozen", "sometimes", "unused"):
                module = nn.Linear(h, h)
            else:
                raise ValueError(attr)
            setattr(self, attr, module)
        if sc.frozen == "layer":
            self.frozen.requires_grad_(False)
        elif sc.frozen == "weight":
            self.frozen.weight.requires_grad_(False)
        if sc.channels_last == "model":
            self.to(memory_format=CL)

    def _part(self, name: str, h: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        if name.startswith("linear"):
            module = getattr(self, name)
            return torch.tanh(module["lin"](h) if isinstance(module, nn.ModuleDict) else module(h))
        if name == "conv":
            z = h.reshape(h.shape[0], -1, 2, 2)
            if self.sc.cl_input:
                z = z.contiguous(memory_format=CL)
            return torch.tanh(self.conv(z)).reshape(h.shape[0], -1)
        if name == "plist":
            return torch.tanh(h @ self.plist[0] + self.plist[1])
        if name == "pdict":
            return torch.tanh(F.linear(h, self.pdict["w"], self.pdict["b"]))
        if name == "fn":
            return torch.tanh(F.linear(h, self.fn.weight, self.fn.bias))
        if name == "tied":
            return torch.tanh(F.linear(h, self.embed.weight))
        if name == "frozen":
            return torch.tanh(self.frozen(h))
        if name == "sometimes":
            return h + torch.tanh(self.sometimes(h)) if use_sometimes else h
        raise ValueError(name)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, use_sometimes: bool = False) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        if self.sc.tied == "first":
            h = h + self.embed(tokens)
        for name in self.sc.parts:
            h = self._part(name, h, use_sometimes)
        if self.sc.tied == "last":
            h = h + self.embed(tokens)
        return self.head(h)


def make_model(sc: Scenario) -> SoakNet:
    torch.manual_seed(sc.seed)
    return SoakNet(sc).to(sc.dtype)


def param_groups(model: SoakNet) -> list[dict]:
    """The scenario's groups over this model's params (by name, so both models get the same groups)."""
    sc = model.sc
    params = {_stable_name(n, sc): p for n, p in model.named_parameters()}
    groups = [{"params": [], "lr": lr, "weight_decay": wd, "betas": betas, "eps": sc.eps}
              for lr, wd, betas in sc.groups]
    for name, p in params.items():
        if p.requires_grad or sc.frozen_in_groups:
            groups[sc.group_of[name]]["params"].append(p)
    return [g for g in groups if g["params"]]


def _stable_name(name: str, sc: Scenario) -> str:
    """named_parameters() name -> param_names() name (drops container levels)."""
    attr, _, rest = name.partition(".")
    return f"{attr}.{rest.rsplit('.', 1)[-1]}"


def batch(sc: Scenario, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, tokens, y) of one rank's micro-batch."""
    gen = torch.Generator().manual_seed(sc.seed * 1_000_003 + 10_000 * step + 100 * micro + rank)
    x = torch.randn(BATCH, sc.d_in, generator=gen).to(sc.dtype)
    tokens = torch.randint(0, sc.hidden, (BATCH,), generator=gen)
    return x, tokens, torch.randn(BATCH, sc.d_out, generator=gen)
