"""ZeRO-2 data parallelism: DistributedFusedAdam and its layout planner.

One concept per module, from the top:
  optimizer.py        DistributedFusedAdam: options and public methods; delegates to the runtime
  runtime.py          ShardRuntime: this rank's params, layout, buckets, sync and step counter
  update.py           the fused update of this rank's shards
  state_view.py       ``opt.state``: a read-only per-param view of the shards; memory_report
  agreement.py        every rank built the optimizer alike (one collective per layout)
  checkpoint/         state dicts, torch.distributed.checkpoint, distopt's own sharded files
  grad_sync.py        backward hooks, gradient buckets, reduce-scatters
  param_sync.py       all-gathers, deferred to the next forward with overlap_param_sync
  moments.py          low-precision moments: layout keys, shard state, kernel arguments
  packing.py          init_params declarations: which params are laid out next, in which dtypes
  tensor_parallel.py  DTensor and Megatron-style model parallelism: local tensors, norms, checks
  buckets.py          one bucket's buffers and shard state on this rank
  layout.py           the bucket/shard planner (pure)
  comm.py             process groups and collectives, named in their errors
  options.py, torch_compat.py   the options' checks; torch.optim.AdamW's keywords
  buffers.py          DDP's buffer broadcast, for the framework integrations
"""

from .layout import Layout, plan_layout
from .optimizer import DistributedFusedAdam

__all__ = ["DistributedFusedAdam", "Layout", "plan_layout"]
