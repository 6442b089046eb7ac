"""What distopt's own sharded checkpoint files (``checkpoint.save``/``load``) hold, and reading them back.

Each rank writes, per param it owns part of, one 1-D tensor per state key and contiguous range, under
``optim.state.<param>.<key>.<first>`` (with its CRC-32 under ``optim.checksum.<param>.<key>.<first>``):
<param> is placement.chunk_name, <first> the range's first element in the param's memory order (a
DTensor's local chunk). The keys are ``state_dict()``'s (dcp_state.fragment_pieces): ``param`` (fp32),
each moment's values (``exp_avg``, ``exp_avg_sq``: fp32 or bf16) or, for an 8-bit moment, its uint8
codes (``exp_avg_codes``, ...) and fp32 absmax scales (``exp_avg_absmax``, ...: <first> counts 256-element
blocks; a codes range starts on a block and its scales are saved with it, under its first block).

Loading reads, into fresh tensors, the saved ranges overlapping this rank's new ones (``requests``) and
hands them to ``load_state_dict`` as the sharded form (``as_state_dict``: ShardedParamStates holding
those ranges), which converts formats, checks coverage and applies everything; so a checkpoint loads
into any world size, bucket size and moment format, and 8-bit codes saved in the loader's format come
back bit for bit.
"""

from __future__ import annotations

import json
import re
import warnings
import zlib
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ...lowprec import formats as mf
from ...lowprec.codecs import QUANT_BLOCK
from .dcp_state import ShardedParamState
from .placement import check_saved_layout, chunk_name, chunk_origin
from .protocol import ShardedOptimizer

SHARDED_FORMAT = "distopt.sharded.v2"
UNVERIFIED_SHARDED_FORMAT = "distopt.sharded.v1"  # before checksums
VALUES = ("exp_avg", "exp_avg_sq")
# Each key's dtypes in a checkpoint: anything else is not a range of this format.
DTYPES = {"param": (torch.float32,), **{k: (torch.float32, torch.bfloat16) for k in VALUES},
          **{k: (torch.uint8,) for k in mf.CODES_KEYS.values()},
          **{k: (torch.float32,) for k in mf.ABSMAX_KEYS.values()}}
_KEY = re.compile(r"^optim\.state\.(\d+(?:@\d+(?:_\d+)*)?)\.(" + "|".join(DTYPES) + r")\.(\d+)$")

Saved = dict[tuple[str, str], list[tuple[int, int]]]  # (param's chunk_name, key) -> [(first, count)]


def parse_meta(text: str, checkpoint_id: str) -> tuple[dict[str, Any], bool]:
    """The shared metadata, and whether the checkpoint has checksums."""
    try:
        outer = json.loads(text)
        fmt = outer.get("format")
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"{checkpoint_id}: the optimizer metadata is not valid JSON ({exc})") from exc
    if fmt == UNVERIFIED_SHARDED_FORMAT:
        warnings.warn(f"{checkpoint_id} was saved without checksums ({fmt}): its data is loaded unverified",
                      stacklevel=4)
        return outer, False
    if fmt != SHARDED_FORMAT:
        raise ValueError(f"{checkpoint_id}: not a distopt sharded checkpoint (format {fmt!r})")
    body = outer.get("body")
    if not isinstance(body, str) or zlib.crc32(body.encode()) != outer.get("crc32"):
        raise ValueError(f"{checkpoint_id}: the optimizer metadata does not match its checksum (corrupted)")
    return json.loads(body), True


def saved_fragments(md: Metadata) -> Saved:
    """Every range in the checkpoint; a count of -1 marks one that is not of this format (a tensor that
    is not 1-D or has another dtype), which ``check_coverage`` refuses."""
    out: Saved = {}
    for fqn, entry in md.state_dict_metadata.items():
        m = _KEY.match(fqn)
        if m:
            ok = isinstance(entry, TensorStorageMetadata) and len(entry.size) == 1 \
                and entry.properties.dtype in DTYPES[m.group(2)]
            out.setdefault((m.group(1), m.group(2)), []).append((int(m.group(3)), int(entry.size[0]) if ok else -1))
    return out


def saved_keys(saved: Saved, name: str) -> list[str]:
    """The state keys saved for the param of chunk_name `name`."""
    return [k for k in DTYPES if (name, k) in saved]


def check_coverage(opt: ShardedOptimizer, checkpoint_id: str, meta: dict[str, Any], saved: Saved,
                   md: Metadata | None) -> None:
    """Every param has the saved shape, memory format and DTensor layout; its master and each moment, in
    one format (values, or codes with their scales), are there; and each saved state tensor (a DTensor's
    local chunk) is tiled exactly once by its ranges (with checksums, where `md` is given)."""
    for g, p, t in zip(opt.checkpoint_indices(), opt.checkpoint_params(), opt.checkpoint_tensors()):
        shape, stride = (tuple(x) for x in meta["params"].get(str(g), ((), ())))
        if shape != tuple(p.shape):
            raise ValueError(f"param {g} has shape {tuple(p.shape)}, the checkpoint {shape}")
        if stride != tuple(p.stride()):
            raise ValueError(f"param {g} was saved in another memory format (strides {stride}, now "
                             f"{tuple(p.stride())}): load the per-param state_dict() form instead")
        check_saved_layout(g, p, meta.get("layouts", {}).get(str(g)))
        name = chunk_name(g, p)
        keys = saved_keys(saved, name)
        for moment in VALUES:
            forms = [k for k in (moment, mf.CODES_KEYS[moment]) if k in keys]
            if len(forms) != 1 or (forms[0] != moment and mf.ABSMAX_KEYS[moment] not in keys):
                raise ValueError(f"{checkpoint_id}: param {name} has {' and '.join(forms) or 'no'} {moment} "
                                 "(it needs its values, or its 8-bit codes with their absmax scales)")
        for moment, codes in mf.CODES_KEYS.items():
            scales = dict(saved.get((name, mf.ABSMAX_KEYS[moment]), []))
            if any(scales.get(start // QUANT_BLOCK) != mf.num_blocks(n) for start, n in saved.get((name, codes), [])):
                raise ValueError(f"{checkpoint_id}: the {codes} of param {name} are not saved with the absmax "
                                 "scales of their blocks")
        for key in dict.fromkeys(("param", *keys)):  # the master is always saved
            blocks = key in mf.ABSMAX_KEYS.values()
            end = 0
            for start, n in sorted(saved.get((name, key), [])):
                if start != end or n < 0 or (key in mf.CODES_KEYS.values() and start % QUANT_BLOCK):
                    break
                if md is not None and f"optim.checksum.{name}.{key}.{start}" not in md.state_dict_metadata:
                    raise ValueError(f"{checkpoint_id}: {key} of param {name} has no checksum for range {start}+")
                end += n
            if end != (mf.num_blocks(t.numel()) if blocks else t.numel()):
                raise ValueError(f"{checkpoint_id}: the saved {key} of param {name} does not cover its "
                                 f"{'blocks' if blocks else f'{t.numel()} elements'} exactly once (1-D ranges "
                                 f"of {' or '.join(str(d) for d in DTYPES[key])} each)")


def requests(opt: ShardedOptimizer, saved: Saved, md: Metadata, verified: bool) -> dict[str, Tensor]:
    """Fresh tensors for the saved ranges that overlap this rank's (and their checksums): state.<...>
    names as dcp.load takes them under ``optim``. An 8-bit moment's codes ranges come with their scales."""
    index = opt.checkpoint_indices()
    names = {g: chunk_name(g, p) for g, p in zip(index, opt.checkpoint_params())}
    out: dict[str, Tensor] = {}

    def take(name: str, key: str, start: int) -> None:
        fqn = f"{name}.{key}.{start}"
        entry = md.state_dict_metadata[f"optim.state.{fqn}"]
        out[f"state.{fqn}"] = torch.empty(entry.size, dtype=entry.properties.dtype)
        if verified:
            out[f"checksum.{fqn}"] = torch.empty(1, dtype=torch.int64)

    for b in opt.shard_buckets():
        for f in b.fragments:
            name = names[index[f.param]]
            for key in saved_keys(saved, name):
                if key in mf.ABSMAX_KEYS.values():
                    continue  # with their codes
                for start, _ in overlapping(saved[(name, key)], f.param_offset, f.numel):
                    take(name, key, start)
                    if key in mf.CODES_KEYS.values():
                        moment = next(m for m, k in mf.CODES_KEYS.items() if k == key)
                        take(name, mf.ABSMAX_KEYS[moment], start // QUANT_BLOCK)
    return out


def as_state_dict(opt: ShardedOptimizer, read: dict[str, Tensor], saved: Saved, meta: dict[str, Any]) -> dict[str, Any]:
    """The ranges `read` (``requests``, filled) as the sharded form of ``state_dict()``, for
    ``load_state_dict``: per param, a ShardedParamState per saved key holding the ranges read here."""
    step = torch.tensor(float(meta["step"]))
    state: dict[int, dict[str, Tensor]] = {}
    for g, p, t in zip(opt.checkpoint_indices(), opt.checkpoint_params(), opt.checkpoint_tensors()):
        name = chunk_name(g, p)
        state[g] = {"step": step}
        for key in saved_keys(saved, name):
            ranges = [(start, read[f"state.{name}.{key}.{start}"]) for start, _ in saved[(name, key)]
                      if f"state.{name}.{key}.{start}" in read]
            dtype = ranges[0][1].dtype if ranges else DTYPES[key][0]
            if key in mf.ABSMAX_KEYS.values():
                state[g][key] = ShardedParamState(torch.Size([mf.num_blocks(p.numel())]), (1,), torch.device("cpu"),
                                                  ranges, dtype=dtype)
            elif p.numel() == 0:
                state[g][key] = torch.zeros(p.shape, dtype=dtype)
            else:
                state[g][key] = ShardedParamState(p.shape, t.stride(), torch.device("cpu"), ranges, t.shape,
                                                  chunk_origin(p), dtype)
    return {"state": state, "param_groups": meta["param_groups"]}


def overlapping(ranges: list[tuple[int, int]], offset: int, numel: int) -> list[tuple[int, int]]:
    return [(start, n) for start, n in ranges if start < offset + numel and offset < start + n]
