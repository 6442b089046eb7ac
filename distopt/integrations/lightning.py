"""Lightning adapter: ``DistributedFusedAdamStrategy`` and gradient clipping for distopt's optimizers.

    trainer = L.Trainer(strategy=DistributedFusedAdamStrategy(), gradient_clip_val=1.0, ...)
    # configure_optimizers() returns DistributedFusedAdam(self.parameters(), ...)

The strategy is Lightning's ``DDPStrategy`` (launch, process group, samplers, collectives) without the
DDP wrapper: DistributedFusedAdam reduce-scatters the gradients itself. ``accumulate_grad_batches``
runs the accumulating backwards under ``opt.no_sync()``; ``gradient_clip_val`` clips through
``opt.clip_grad_norm`` (torch's ``clip_grad_norm_`` would see no ``.grad``: the optimizer moved them
into its buckets); every rank takes part in a checkpoint's gathering of the sharded state (rank 0
assembles and writes it); resumed on as many ranks, a run continues bit for bit as if never stopped.
Before each training step that synchronises, rank 0's buffers (BatchNorm statistics) are broadcast, as
DDP's ``broadcast_buffers=True`` does.

Lightning ships two namespaces, ``lightning.pytorch`` and ``pytorch_lightning``, whose classes are
distinct. ``DistributedFusedAdamStrategy(...)`` builds the strategy for the namespace already
imported (pass ``namespace="pytorch_lightning"`` or ``"lightning"`` where both are).

``FusedAdam`` under Lightning's own strategies: Lightning's ``MixedPrecision`` refuses
clipping for every optimizer with ``_step_supports_amp_scaling`` (the flag that lets ``GradScaler``
hand the unscale to ``step()``), even under bf16, which has no scaler. Put ``DistoptGradientClipping``
first among the LightningModule's bases: it clips distopt's optimizers itself, unscaling first where
there is a scaler, and leaves other optimizers (and Lightning's check for them) as they were, and norm
clipping under FSDPStrategy (FSDP1: its flat shards' norm is a rank's own) to Lightning, which refuses
it. (Never give DistributedFusedAdam to strategy="ddp": DDP and the optimizer would both handle the
gradients.)
Importing this module does not import Lightning; building a strategy does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..distributed import DistributedFusedAdam
from ..distributed.buffers import BufferSync
from ..grad_scaling import GradScaling

__all__ = ["DistoptGradientClipping", "DistributedFusedAdamStrategy", "clip_gradients", "strategy_class"]

NAMESPACES = {"lightning": "lightning.pytorch", "lightning.pytorch": "lightning.pytorch",
              "pytorch_lightning": "pytorch_lightning"}
PACKING_ORDER = "distopt_packing_order"  # our key in a saved DistributedFusedAdam state dict


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one


def _algorithm(algorithm: Any) -> str:
    return str(getattr(algorithm, "value", algorithm) or "norm").lower()  # a GradClipAlgorithmType, a str or None


def clip_gradients(optimizer: Any, clip_val: float | None, algorithm: Any = "norm", scaler: Any = None) -> bool:
    """Clips a distopt optimizer's gradients as Lightning's ``gradient_clip_val`` asks; returns False
    (doing nothing) for other optimizers. `scaler`: the precision plugin's GradScaler, if any."""
    opt = _unwrap(optimizer)
    if not isinstance(opt, GradScaling):
        return False
    if not clip_val or clip_val <= 0:
        return True
    algorithm = _algorithm(algorithm)
    # Lightning skips scaler.unscale_ for optimizers that unscale in step(): the grads are still scaled.
    ready = scaler is not None and scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY
    if algorithm == "norm":
        if ready:
            opt.unscale_grads(grad_scaler=scaler)  # folded into the update, so the clip sees true grads
        opt.clip_grad_norm(clip_val)
    elif isinstance(opt, DistributedFusedAdam):
        raise NotImplementedError("DistributedFusedAdam clips by norm only (gradient_clip_algorithm='norm'): "
                                  "its gradients are sharded, not in .grad")
    else:  # FusedAdam keeps its grads in .grad: clip them in place, once truly unscaled
        if ready:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_value_([p for g in opt.param_groups for p in g["params"]], clip_val)
    return True


class DistoptGradientClipping:
    """LightningModule mixin (list it before ``LightningModule``): ``gradient_clip_val`` clips distopt's
    optimizers under any strategy and precision, ``bf16-mixed`` and ``16-mixed`` included."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        # FSDPStrategy (FSDP1) gives the optimizer each rank's flat shards as plain tensors: their norm is this
        # rank's alone. Lightning refuses norm clipping there for every optimizer: leave it to Lightning.
        fsdp1_norm = _algorithm(gradient_clip_algorithm) == "norm" and any(
            cls.__name__ == "FSDPStrategy" for cls in type(self.trainer.strategy).__mro__)
        if fsdp1_norm or not clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm, scaler):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


class _RoutedClip:
    """Replaces a precision plugin's ``clip_gradients`` (on the instance; a module-level class so the
    plugin still pickles for spawn launchers): distopt optimizers clip themselves, others as before."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def __call__(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
        if not clip_gradients(optimizer, clip_val, gradient_clip_algorithm, getattr(self.plugin, "scaler", None)):
            type(self.plugin).clip_gradients(self.plugin, optimizer, clip_val, gradient_clip_algorithm)


class _StrategyMixin:
    """The DistributedFusedAdam parts, layered over the namespace's DDPStrategy."""

    def setup(self, trainer: Any) -> None:
        plugin = self.precision_plugin
        self.precision_plugin = plugin  # the getter builds a fresh default each time until one is set
        if not isinstance(plugin.__dict__.get("clip_gradients"), _RoutedClip):
            plugin.clip_gradients = _RoutedClip(plugin)
        super().setup(trainer)
        if trainer.state.fn == "fit":
            others = [type(o).__name__ for o in self.optimizers if not isinstance(_unwrap(o), DistributedFusedAdam)]
            if others:  # without DDP nothing would average their gradients: refuse rather than diverge
                raise TypeError(f"DistributedFusedAdamStrategy: configure_optimizers must return DistributedFusedAdam "
                                f"optimizers only, got {others} (use strategy='ddp' for those)")

    def configure_ddp(self) -> None:
        # No DDP wrapper: the optimizer synchronises gradients. Keep what DDP's constructor does first:
        # every rank starts from rank 0's params and buffers.
        importlib.import_module(f"{self._namespace}.strategies.ddp")._sync_module_states(self.model)

    def _dfas(self) -> list[DistributedFusedAdam]:
        return [o for o in map(_unwrap, self.optimizers) if isinstance(o, DistributedFusedAdam)]

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning's accumulation backwards: gradients stay local until the step's backward."""
        with contextlib.ExitStack() as stack:
            for opt in self._dfas():
                stack.enter_context(opt.no_sync())
            self._accumulating = True
            stack.callback(setattr, self, "_accumulating", False)
            yield

    # Rank 0's buffers (BatchNorm statistics) are broadcast when DDP(broadcast_buffers=True) would: at
    # the forward after one whose gradients were synchronised (see distopt.distributed.buffers).
    def _before_forward(self, synchronising: bool) -> None:
        if getattr(self, "_buffer_sync", None) is None or self._buffer_sync.module is not self.lightning_module:
            self._buffer_sync = BufferSync(self.lightning_module)
        self._buffer_sync.before_forward(synchronising)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward(torch.is_grad_enabled() and not getattr(self, "_accumulating", False))
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward(False)
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward(False)
        return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward(False)
        return super().predict_step(*args, **kwargs)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        opt = _unwrap(optimizer)
        if not isinstance(opt, DistributedFusedAdam):
            return super().optimizer_state(optimizer)
        # A collective: Trainer.save_checkpoint dumps the checkpoint on every rank (and only rank 0
        # writes it), so each rank sends its shards and only rank 0 assembles them.
        sd = opt.state_dict(gather_on_rank0=True)
        if sd is None:
            return {}
        # The bucket layout fixes the grad norm's summation order, so the clip's last bits. A resumed
        # run lays its buckets out when it loads, before any backward: in this order, it resumes exactly.
        sd[PACKING_ORDER] = list(dict.fromkeys(piece.param for b in opt.shard_buckets(build=False)
                                               for piece in b.spec.pieces))
        return sd

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        states = []
        for optimizer, sd in zip(self.optimizers, checkpoint["optimizer_states"]):
            opt, sd = _unwrap(optimizer), dict(sd)
            order = sd.pop(PACKING_ORDER, None)
            params = opt.checkpoint_params() if isinstance(opt, DistributedFusedAdam) else []
            if order is not None and sorted(order) == list(range(len(params))) and not opt.shard_buckets(False):
                opt.init_params([params[i] for i in order])
            states.append(sd)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})

    def teardown(self) -> None:
        # Lightning moves every optimizer's state to the CPU here by assigning opt.state[p][key]. A
        # DistributedFusedAdam's state is a view of its shards, which refuses writes that would do
        # nothing: leave it out (its shards stay where they are, as they always did).
        kept = self.optimizers
        self.optimizers = [o for o in kept if not isinstance(_unwrap(o), DistributedFusedAdam)]
        try:
            super().teardown()
        finally:
            self.optimizers = kept

    def on_train_end(self) -> None:
        # overlap_param_sync defers the last all-gather to a forward that never comes: the model must
        # leave fit() stepped. (model.state_dict(), so checkpoints, lands it by itself.)
        for opt in self._dfas():
            opt.param_sync()
        super().on_train_end()


def _namespace(namespace: str | None) -> str:
    if namespace is not None:
        if namespace not in NAMESPACES:
            raise ValueError(f"namespace must be one of {sorted(NAMESPACES)}, got {namespace!r}")
        return NAMESPACES[namespace]
    loaded = [ns for ns in ("lightning.pytorch", "pytorch_lightning") if ns in sys.modules]
    if len(loaded) == 2:
        raise ValueError("both lightning and pytorch_lightning are imported: pass namespace='lightning' or "
                         "'pytorch_lightning', the package your Trainer comes from")
    if loaded:
        return loaded[0]
    return "lightning.pytorch" if importlib.util.find_spec("lightning") else "pytorch_lightning"


def strategy_class(namespace: str | None = None) -> type:
    """The strategy class for a Lightning namespace (a subclass of its DDPStrategy)."""
    return _build(_namespace(namespace))


def _class_name(ns: str) -> str:
    return f"DistributedFusedAdamStrategy_{ns.replace('.', '_')}"


@functools.cache
def _build(ns: str) -> type:
    base = importlib.import_module(f"{ns}.strategies").DDPStrategy
    return type(_class_name(ns), (_StrategyMixin, base), {"_namespace": ns, "__module__": __name__, "__doc__": __doc__})


def __getattr__(name: str) -> type:
    # pickle finds the built classes here by name, also in a fresh process (spawn launchers)
    for ns in ("lightning.pytorch", "pytorch_lightning"):
        if name == _class_name(ns):
            return _build(ns)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _AnyNamespace(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _StrategyMixin)


class DistributedFusedAdamStrategy(metaclass=_AnyNamespace):
    """``DistributedFusedAdamStrategy(namespace=None, **DDPStrategy_kwargs)``: the strategy for the
    imported Lightning namespace (see the module docstring). DDPStrategy's keyword arguments
    (``process_group_backend``, ``timeout``, ``start_method``, ...) pass through; DDP's own do not apply."""

    def __new__(cls, *args: Any, namespace: str | None = None, **kwargs: Any) -> Any:
        return strategy_class(namespace)(*args, **kwargs)
