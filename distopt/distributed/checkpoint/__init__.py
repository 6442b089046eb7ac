"""DistributedFusedAdam checkpoints that resume under any world size, bucket size or init order.

Two forms, both keyed by a param's position in ``param_groups`` (torch's convention):

* ``state_dict()``: per param, the fp32 master ``param``, ``exp_avg`` and ``exp_avg_sq`` in the
  param's logical shape (on the CPU), and ``step``; plus ``param_groups`` and ``checksums`` (the
  CRC-32 of every state tensor). It is torch.optim.AdamW's format with one more state key
  (``param``) and two top-level keys that AdamW and FusedAdam ignore, so it loads into both, and
  theirs (which have no checksums) load here. It is assembled bucket by bucket (one all-gather of
  the bucket's shards at a time), so the extra device memory stays near one bucket; the result is
  the whole state on the CPU of every rank (of rank 0 only with ``gather_on_rank0``). It is also what
  torch.distributed.checkpoint's ``get_state_dict`` reads, which re-keys it by param name (FQN):
  loading accepts either key, matched through the saved ``param_groups`` as torch.optim does.
* ``state_dict(sharded=True)``, which plain ``state_dict()`` returns inside
  ``sharded_state_dicts(opt)`` (so that torch's ``get_state_dict`` and ``dcp.save``/``dcp.load``
  of the optimizer see it): the same structure with no ``format`` or ``checksums``, whose state
  tensors hold only this rank's elements of each param, as views of its shard (dcp_state.py):
  nothing is gathered or copied, and torch.distributed.checkpoint reshards it itself.
* ``save(opt, path, extra)`` / ``load(opt, path, extra)``: sharded through
  ``torch.distributed.checkpoint``: each rank writes only the contiguous ranges of each param it
  owns, in the param's memory order (low-precision moments in their format), each with its CRC-32
  under its own key, plus the CRC-32 of every tensor in `extra`; on load each rank reads just the
  saved ranges that overlap its new ones (files.py, file_format.py).
  The save is crash-consistent: written beside the path and switched in atomically
  (atomic_replace.py), so the path always holds one complete checkpoint.

Loading is all or nothing. It checks the format, param count, shapes, coverage and (where the
checkpoint has them) the checksums of everything it reads, into fresh tensors, on every rank,
before changing anything: a truncated, garbled or bit-flipped checkpoint is refused with a
ValueError on every rank and the optimizer and `extra` are left exactly as they were. Only then
does it copy `extra` into the caller's tensors and rewrite the optimizer state in place (a
captured CUDA graph stays valid) and the model params from the fp32 masters, so the model must be
loaded first or with the same checkpoint. A state dict that was edited on purpose loads once its
``checksums`` entry is deleted.

Checkpoints without checksums are accepted unverified: torch's and FusedAdam's state dicts, and
sharded checkpoints of the first format (``distopt.sharded.v1``, with a warning), which still get
every other check and the all-or-nothing load.

The package: this module is its one entrance. state_dict.py (the per-param form), dcp_state.py and
boxes.py (the sharded form for torch.distributed.checkpoint), files.py and file_format.py (distopt's
own sharded files), moments.py (low-precision moments in all of them), placement.py (DTensor params),
extra.py (``extra`` of save/load), atomic_replace.py (crash-consistent replacement). It uses the
optimizer only through the ``ShardedOptimizer`` protocol (protocol.py): the optimizer imports this
package, never the reverse.
"""

from .dcp_state import ShardedParamState, sharded_state_dicts
from .file_format import SHARDED_FORMAT, UNVERIFIED_SHARDED_FORMAT
from .files import load, save, sharded_state_dict
from .protocol import ShardedOptimizer
from .state_dict import FORMAT, STATE_KEYS, load_state_dict, state_dict

__all__ = [
    "FORMAT",
    "SHARDED_FORMAT",
    "STATE_KEYS",
    "UNVERIFIED_SHARDED_FORMAT",
    "ShardedOptimizer",
    "ShardedParamState",
    "load",
    "load_state_dict",
    "save",
    "sharded_state_dict",
    "sharded_state_dicts",
    "state_dict",
]
