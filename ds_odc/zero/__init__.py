"""ZeRO-3 with ODC: DeepSpeed's stage-3 optimizer and parameter coordinator, subclassed at their seams."""

from ds_odc.zero.gather import OdcParamCoordinator, ParamGather
from ds_odc.zero.optimizer import OdcOptimizer

__all__ = ["OdcOptimizer", "OdcParamCoordinator", "ParamGather"]
