"""ZeRO-3 with ODC: DeepSpeed's stage-3 optimizer and parameter coordinator, subclassed at their seams, moving data
through one :class:`~ds_odc.zero.state.OdcState` per engine. ``SUPPORTED_DEEPSPEED``: the DeepSpeed versions those
seams are checked against; ``tag_minibatch``: what a training loop calls per minibatch so that a rank that skipped a
step is named at once."""

from ds_odc.zero._deepspeed_privates import SUPPORTED as SUPPORTED_DEEPSPEED
from ds_odc.zero.coordinator import OdcParamCoordinator
from ds_odc.zero.engine import holds_replica, tag_minibatch
from ds_odc.zero.minibatch import MinibatchMismatch, MinibatchTag
from ds_odc.zero.optimizer import OdcOptimizer
from ds_odc.zero.state import OdcState, Phase

__all__: list[str] = []
