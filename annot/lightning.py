"""annot as a Lightning strategy, for the ``Trainer`` and for ``Fabric``.

``Trainer(strategy=annot.lightning.Strategy(checkpoint=True))`` and
``Fabric(strategy=annot.lightning.FabricStrategy())`` are Lightning's own
``ModelParallelStrategy`` (FSDP2, torch distributed checkpoints for save and resume),
with the parallelization written for you:

- the module tree Lightning holds after ``configure_model`` (the ``LightningModule``; in
  Fabric the module given to ``setup_module``) is planned and handed to
  ``annot.auto_wrap(..., "fsdp2")``: the Plan's units sharded, its blocks checkpointed
  inside them, transformers models adjusted (``use_cache=False`` in training forwards);
- the whole world is data parallel unless told otherwise (Lightning's own default, a
  data-parallel size of the node count, leaves the ranks of one node training copies
  nothing synchronises; annot refuses such a mesh, docs/design.md pitfall 21, in
  `annot.engines.fsdp2.refuse_unsynchronised_mesh`);
- ``empty_init=True`` (``trainer.init_module``, ``fabric.init_module``) builds under
  `annot.meta_init`, so the model is materialized shard by shard with the values eager
  construction gives (Lightning's plain meta device leaves buffers such as causal masks
  as garbage: docs/design.md, pitfall 1);
- a tree already sharded with FSDP2 (``annot.from_pretrained(path, "fsdp2")`` or
  ``annot.auto_wrap`` in ``configure_model``) is left as it is.

In the Trainer the ``LightningModule`` is the FSDP2 root, so its ``training_step`` (and
the validation, test and predict steps) run through its ``forward`` hooks, as Lightning
does for its own wrappers. Lightning refuses FSDP1 and DeepSpeed strategies on CPU; for
those, pass `annot.fsdp1_policies` to ``FSDPStrategy`` and
``annot.deepspeed_config(..., for_="lightning")`` to ``DeepSpeedStrategy``.

fp16: Lightning owns precision here, and its ``ModelParallelStrategy`` has no loss scaler
(it refuses ``precision="16-mixed"``). fp16 compute without one underflows small
gradients to zero, silently (docs/design.md, pitfall 34), so the strategies refuse
annot's ``mixed_precision="fp16"`` and log a warning for Lightning's
``precision="16-true"``. Use bf16 (``"bf16-mixed"``, ``"bf16-true"``,
``mixed_precision="bf16"``), or train fp16 with ``annot.auto_wrap(..., optimizer=...)``,
whose `Trainable` scales the loss.

Lightning is imported inside the functions: ``import annot.lightning`` stays light, and
the classes are built on first use (``pip install 'annot-train[lightning]'``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

from annot.engines.base import is_fp16, resolve_dtype
from annot.engines.fsdp2 import holds_fsdp2
from annot.meta.deferred import meta_init
from annot.policies import Plan, Policy, Rule
from annot.wrap import auto_wrap

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    # Built on first access by __getattr__ below (they subclass Lightning's classes).
    Strategy: type
    FabricStrategy: type

__all__ = ["FabricStrategy", "Strategy", "register", "parallelize"]

logger = logging.getLogger("annot.lightning")

PolicyLike = Policy | Rule | Plan | None


_NO_SCALER = ("Lightning's ModelParallelStrategy has no loss scaler (it refuses "
              "precision='16-mixed'), so fp16 gradients below fp16's range would underflow to "
              "zero, silently")


def _refuse_fp16(engine_options: dict[str, Any]) -> None:
    """annot's own fp16 compute under Lightning, which cannot scale the loss."""
    if is_fp16(resolve_dtype(engine_options.get("mixed_precision"))):
        raise ValueError(
            f"annot.lightning: mixed_precision='fp16' computes in fp16, but {_NO_SCALER}. Use "
            "mixed_precision='bf16' (or Lightning's precision='bf16-mixed'), or train fp16 with "
            "annot.auto_wrap(model, 'fsdp2', mixed_precision='fp16', optimizer=...), whose "
            "Trainable scales the loss")


def _warn_fp16_without_scaler(precision: Any) -> None:
    """Lightning's ``precision="16-true"`` (the whole model in fp16) is Lightning's choice:
    said, not refused."""
    if getattr(precision, "precision", None) == "16-true":
        logger.warning("precision='16-true' trains in fp16 and %s: prefer 'bf16-true' or "
                       "'bf16-mixed'", _NO_SCALER)


def parallelize(module: nn.Module, mesh: DeviceMesh, *, policy: PolicyLike = None,
                checkpoint: bool | None = None, device: Any = None,
                **engine_options: Any) -> nn.Module:
    """What the strategies do to the module Lightning holds: ``auto_wrap(module, "fsdp2",
    policy, mesh=<the data-parallel dimension of mesh>)``, or nothing if the tree is
    already sharded with FSDP2 (logged). Usable as ``ModelParallelStrategy``'s
    ``parallelize_fn`` too (``functools.partial(parallelize, checkpoint=True)``).
    ``mixed_precision="fp16"`` is refused: Lightning would not scale the loss."""
    _refuse_fp16(engine_options)
    if holds_fsdp2(module):
        logger.warning("%s is already sharded with FSDP2 (annot.from_pretrained or auto_wrap in "
                       "configure_model): the strategy leaves it as it is", type(module).__name__)
        return module
    dp_mesh = mesh["data_parallel"] if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names \
        else mesh
    return auto_wrap(module, "fsdp2", policy, checkpoint=checkpoint, mesh=dp_mesh, device=device,
                     **engine_options)


def _engine_is_fsdp2(engine: str) -> None:
    if engine not in ("fsdp2", "fully_shard"):
        raise ValueError(
            f"annot.lightning strategies run FSDP2 (Lightning's ModelParallelStrategy), not "
            f"{engine!r}: for FSDP1 pass annot.fsdp1_policies(model) to Lightning's "
            "FSDPStrategy(auto_wrap_policy=..., activation_checkpointing_policy=...); for "
            "DeepSpeed pass annot.deepspeed_config(model, for_='lightning') to "
            "DeepSpeedStrategy(config=...) and annot.apply_checkpointing(model, engine='deepspeed')")


def _lightning_own(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pops the ``ModelParallelStrategy`` arguments out of ``kwargs`` (the rest is annot's)."""
    keys = ("save_distributed_checkpoint", "process_group_backend", "timeout")
    return {k: kwargs.pop(k) for k in keys if k in kwargs}


def _whole_world_data_parallel(strategy: Any) -> None:
    """``data_parallel_size="auto"``: the whole world (over the tensor-parallel size), not
    Lightning's node count, which leaves one node's ranks unsynchronised."""
    if strategy._data_parallel_size == "auto":
        tp = strategy._tensor_parallel_size
        strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes // (
            1 if tp == "auto" else int(tp))


def _redirected(method: str, context: str) -> Any:
    """A Trainer strategy's ``<method>`` that runs the LightningModule's ``method`` through
    its ``forward`` (Lightning's forward redirection, the module being its own wrapper),
    inside the precision plugin's ``context``."""

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        with getattr(self.precision_plugin, context)():
            return self._forward_redirection(self.model, self.lightning_module, method,
                                             *args, **kwargs)

    step.__name__ = method
    return step


@contextlib.contextmanager
def _annot_empty_init(empty_init: bool | None, inner: Any) -> Iterator[None]:
    """Lightning's ``empty_init=True`` as `annot.meta_init` (values recorded, replayed
    shard by shard), inside the precision plugin's own context."""
    with contextlib.ExitStack() as stack:
        if empty_init:
            stack.enter_context(meta_init())
        stack.enter_context(inner)
        yield


@functools.cache
def _trainer_strategy() -> type:
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.trainer.states import TrainerFn

    class AnnotStrategy(ModelParallelStrategy):
        """Lightning Trainer strategy: FSDP2 applied by annot to the ``LightningModule``.

        Args:
            engine: ``"fsdp2"`` (the only engine Lightning's model-parallel strategy runs).
            policy: what `annot.auto_wrap` takes (``None``: marks, else HuggingFace
                ``_no_split_modules``), evaluated on the whole ``LightningModule``.
            checkpoint: ``None`` as the Plan says, ``True`` every unit, ``False`` none.
            data_parallel_size: default the whole world; with ``tensor_parallel_size``
                > 1 apply tensor parallelism in ``configure_model`` yourself.
            save_distributed_checkpoint, process_group_backend, timeout: Lightning's.
            engine_options: FSDP2 options (``offload``, ``reshard_after_forward``,
                ``mixed_precision``: ``"bf16"``, not ``"fp16"``, which Lightning cannot
                scale; ``offload_activations``).
        """

        strategy_name = "annot"

        def __init__(self, engine: str = "fsdp2", policy: PolicyLike = None, *,
                     checkpoint: bool | None = None, data_parallel_size: Any = "auto",
                     tensor_parallel_size: Any = 1, **kwargs: Any) -> None:
            _engine_is_fsdp2(engine)
            _refuse_fp16(kwargs)
            super().__init__(data_parallel_size=data_parallel_size,
                             tensor_parallel_size=tensor_parallel_size, **_lightning_own(kwargs))
            self._annot = dict(policy=policy, checkpoint=checkpoint, **kwargs)

        def setup_environment(self) -> None:
            _whole_world_data_parallel(self)
            super().setup_environment()

        def setup(self, trainer: Any) -> None:
            # ModelParallelStrategy.setup, with annot's wrapping in place of the user's
            # configure_model parallelization and of Lightning's reset_parameters()
            # materialization (annot fills meta_init models itself).
            assert self.model is not None and self.accelerator is not None
            self.accelerator.setup(trainer)
            _warn_fp16_without_scaler(self.precision_plugin)
            self.model = parallelize(self.model, self.device_mesh, device=self.root_device,
                                     **self._annot)
            self.model = self.precision_plugin.convert_module(self.model)
            self.barrier()
            if trainer.state.fn == TrainerFn.FITTING:
                self.setup_optimizers(trainer)
            self.setup_precision_plugin()
            if trainer.state.fn == TrainerFn.FITTING:
                _optimizers_to_device(self.optimizers, self.root_device)

        def model_to_device(self) -> None:
            """Nothing: auto_wrap placed the states (offloaded ones stay on the host)."""

        @contextlib.contextmanager
        def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
            with _annot_empty_init(empty_init, self.precision_plugin.tensor_init_context()):
                yield

        # The LightningModule is the FSDP2 root: its steps go through its forward, so the
        # root's hooks (all-gather of what no unit holds, backward hooks) run.
        training_step = _redirected("training_step", "train_step_context")
        validation_step = _redirected("validation_step", "val_step_context")
        test_step = _redirected("test_step", "test_step_context")
        predict_step = _redirected("predict_step", "predict_step_context")

    AnnotStrategy.__qualname__ = AnnotStrategy.__name__ = "Strategy"
    AnnotStrategy.__module__ = __name__
    return AnnotStrategy


@functools.cache
def _fabric_strategy() -> type:
    from lightning.fabric.strategies import ModelParallelStrategy

    class AnnotFabricStrategy(ModelParallelStrategy):
        """Fabric strategy: FSDP2 applied by annot to the module given to
        ``fabric.setup_module`` (arguments as `Strategy`'s)."""

        def __init__(self, engine: str = "fsdp2", policy: PolicyLike = None, *,
                     checkpoint: bool | None = None, data_parallel_size: Any = "auto",
                     tensor_parallel_size: Any = 1, **kwargs: Any) -> None:
            _engine_is_fsdp2(engine)
            _refuse_fp16(kwargs)
            super().__init__(self._parallelize, data_parallel_size=data_parallel_size,
                             tensor_parallel_size=tensor_parallel_size, **_lightning_own(kwargs))
            self._annot = dict(policy=policy, checkpoint=checkpoint, **kwargs)

        def _parallelize(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
            _warn_fp16_without_scaler(self.precision)
            return parallelize(module, mesh, device=self.root_device, **self._annot)

        def setup_environment(self) -> None:
            _whole_world_data_parallel(self)
            super().setup_environment()

        def module_init_context(self, empty_init: bool | None = None) -> Any:
            return _annot_empty_init(empty_init, self.precision.module_init_context())

    AnnotFabricStrategy.__qualname__ = AnnotFabricStrategy.__name__ = "FabricStrategy"
    AnnotFabricStrategy.__module__ = __name__
    return AnnotFabricStrategy


def register() -> None:
    """Register ``strategy="annot"`` with the Trainer's and Fabric's registries (once)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for registry, cls in ((StrategyRegistry, _trainer_strategy()),
                          (STRATEGY_REGISTRY, _fabric_strategy())):
        if "annot" not in registry:
            registry.register("annot", cls, description="annot: the Plan applied with FSDP2")


def __getattr__(name: str) -> Any:
    # The classes subclass Lightning's, so they exist once Lightning is imported.
    if name == "Strategy":
        cls = _trainer_strategy()
    elif name == "FabricStrategy":
        cls = _fabric_strategy()
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register()
    return cls
