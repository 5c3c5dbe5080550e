"""ds_odc: On-Demand Communication for DeepSpeed ZeRO-3.

``import ds_odc`` before building the model or calling ``deepspeed.initialize``; then
``"zero_optimization": {"stage": 3, "odc": true}`` in the ds_config turns ODC on. Without the key DeepSpeed
behaves exactly as stock.
"""

from __future__ import annotations

__version__ = "0.1.0"

_patched = False


def _import_deepspeed_quietly() -> None:
    """DeepSpeed logs its accelerator choice to *stdout* while importing; route that line to stderr so that tools
    such as ``python -m ds_odc.balancer.simulate --json`` print only their output, then give its logger stdout back."""
    import sys
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
    """Teach DeepSpeed the ``odc`` key and hook its stage-3 optimizer construction. Idempotent; run at import."""
    global _patched
    if _patched:
        return
    _import_deepspeed_quietly()
    from ds_odc.config import OdcZeroConfig
    from ds_odc.zero import _deepspeed_privates as privates
    from ds_odc.zero.blocks import fetch_by_block
    from ds_odc.zero.optimizer import OdcOptimizer
    from ds_odc.zero.validate import validate_engine

    def prepare_engine(engine, optimizer) -> bool:
        if not validate_engine(engine, optimizer):
            return False
        zero_config = engine._config.zero_config
        fetch_by_block(engine.module, zero_config, zero_config.odc.fetch_unit)
        return True

    privates.check_deepspeed()
    privates.install_config_model(OdcZeroConfig)
    privates.install_optimizer_hook(OdcOptimizer, prepare_engine)
    _patched = True


patch()

from ds_odc.config import OdcConfig  # noqa: E402
from ds_odc.loss import count_loss_tokens, global_mean_weight, token_loss_sum  # noqa: E402
from ds_odc.ops.transport import FenceTimeout, OdcError  # noqa: E402

__all__ = ["OdcConfig", "FenceTimeout", "OdcError", "patch", "global_mean_weight", "token_loss_sum",
           "count_loss_tokens", "__version__"]
