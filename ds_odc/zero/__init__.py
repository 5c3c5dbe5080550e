"""ZeRO-3 with ODC: DeepSpeed's stage-3 optimizer and parameter coordinator, subclassed at their seams, moving data
through one :class:`~ds_odc.zero.state.OdcState` per engine."""

from ds_odc.zero.coordinator import OdcParamCoordinator
from ds_odc.zero.optimizer import OdcOptimizer
from ds_odc.zero.state import OdcState

__all__ = ["OdcOptimizer", "OdcParamCoordinator", "OdcState"]
