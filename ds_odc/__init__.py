"""ds_odc: On-Demand Communication for DeepSpeed ZeRO-3.

``import ds_odc`` before building the model or calling ``deepspeed.initialize``; then
``"zero_optimization": {"stage": 3, "odc": true}`` in the ds_config turns ODC on. Without the key DeepSpeed
behaves exactly as stock.

The import itself loads no DeepSpeed (so ``ds_odc.balancer`` stays pure Python): it teaches DeepSpeed the ``odc``
key at once when DeepSpeed is already imported, or else the moment DeepSpeed's import completes, which is before
anything can build an engine or enter ``zero.Init``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

__version__ = "0.1.0"

_patched = False

# Public names, imported on first use: each of them pulls in torch, and OdcConfig DeepSpeed.
_LAZY_EXPORTS = {
    "OdcConfig": "ds_odc.config",
    "FenceTimeout": "ds_odc.ops.transport",
    "OdcError": "ds_odc.ops.transport",
    "global_mean_weight": "ds_odc.training.loss",
    "token_loss_sum": "ds_odc.training.loss",
    "count_loss_tokens": "ds_odc.training.loss",
    "tag_minibatch": "ds_odc.zero.engine",
    "MinibatchMismatch": "ds_odc.zero.minibatch",
}
__all__ = [*_LAZY_EXPORTS, "patch", "__version__"]


def _import_deepspeed_quietly() -> None:
    """DeepSpeed logs its accelerator choice to *stdout* while importing; route that line to stderr so that tools
    such as ``python -m ds_odc`` print only their output, then give its logger stdout back."""
    if "deepspeed" in sys.modules:
        return
    stdout = sys.stdout
    sys.stdout = sys.stderr
    try:
        import deepspeed  # noqa: F401
    finally:
        sys.stdout = stdout
    from deepspeed.utils import logger
    for handler in logger.handlers:
        if getattr(handler, "stream", None) is sys.stderr and stdout is not sys.stderr:
            handler.setStream(stdout)


def patch() -> None:
    """Teach DeepSpeed the ``odc`` key and hook its stage-3 optimizer construction; on a machine without an
    accelerator, spare ``deepspeed.init_distributed`` the build of an op that only inference uses. Idempotent.

    ``import ds_odc`` arranges this by itself; calling it imports DeepSpeed now if it is not imported yet."""
    global _patched
    if _patched:
        return
    _import_deepspeed_quietly()
    from ds_odc.config import OdcZeroConfig
    from ds_odc.zero import _deepspeed_privates as privates
    from ds_odc.training.blocks import transformer_blocks
    from ds_odc.training.compile import compile_blocks_on_engine_compile
    from ds_odc.zero.blocks import fetch_by_block
    from ds_odc.zero.engine import holds_replica
    from ds_odc.zero.hybrid import shard_group_for
    from ds_odc.zero.optimizer import OdcOptimizer
    from ds_odc.zero.validate import validate_engine

    def prepare_engine(engine, optimizer) -> bool:
        if not validate_engine(engine, optimizer):
            return False
        zero_config = engine._config.zero_config
        fetch_by_block(transformer_blocks(engine.module), zero_config, zero_config.odc.fetch_unit)
        # torch_compile=True (Accelerate calls engine.compile) compiles the blocks, with the hooks outside them
        compile_blocks_on_engine_compile(engine)
        return True

    privates.check_deepspeed()
    privates.skip_cpu_shm_op_build()
    privates.install_config_model(OdcZeroConfig)
    privates.install_optimizer_hook(OdcOptimizer, prepare_engine)
    privates.install_zero_init_group(shard_group_for)
    privates.install_checkpoint_writers(holds_replica)
    privates.install_planned_loop(_planned_loader)
    _patched = True


def _planned_loader(engine, dataset, collate_fn):
    """``deepspeed.initialize(training_data=...)``'s loader under ``zero_optimization.odc.balancer`` (imported when
    first built)."""
    from ds_odc.training.planned_loader import make_planned_loader
    return make_planned_loader(engine, dataset, collate_fn)


class _PatchAfterDeepSpeedImport(importlib.abc.MetaPathFinder):
    """Runs :func:`patch` right after ``deepspeed``'s module has executed, then leaves ``sys.meta_path``.

    When DeepSpeed's import happens inside the import of a ds_odc module (``from ds_odc.config import ...`` first),
    the patch waits until every ds_odc module being imported has finished, since it needs them whole. Every other
    name, and a mere lookup (``importlib.util.find_spec``), is untouched."""

    def __init__(self):
        self.importing = 0  # ds_odc modules executing right now
        self.pending = False  # DeepSpeed is in, the patch waits for those modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed" and not fullname.startswith("ds_odc."):
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module
        ours = fullname != "deepspeed"

        def exec_module(module):
            self.importing += ours
            try:
                execute(module)
            finally:
                self.importing -= ours
            self.pending = self.pending or not ours
            if self.pending and self.importing == 0:
                self.pending = False
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                patch()

        loader.exec_module = exec_module  # this spec's own loader instance: one import, nothing shared
        return spec


def __getattr__(name: str):
    if name not in _LAZY_EXPORTS:
        raise AttributeError(f"module 'ds_odc' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY_EXPORTS))


if "deepspeed" in sys.modules:
    patch()
elif not any(isinstance(f, _PatchAfterDeepSpeedImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchAfterDeepSpeedImport())
