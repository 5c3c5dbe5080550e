"""Every place where ds_odc touches a DeepSpeed private lives in this module.

Supported: ``deepspeed>=0.19.8,<0.20`` (line numbers in ``shared/design/deepspeed_seams.md``). ``check_deepspeed()``
feature-detects each symbol at import so a DeepSpeed that moved one fails with a version message, never a hang.
Each override below carries one line saying why it exists.
"""

from __future__ import annotations

import contextlib
import functools

import deepspeed
from packaging.version import Version

SUPPORTED = ">=0.19.8,<0.20"
_MIN, _MAX = Version("0.19.8"), Version("0.20")

# Mangled names of DeepSpeedZeroOptimizer_Stage3 members that ODC overrides or reads.
AVG_SCATTER_GRADS = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
PARAM_ID_TO_GRAD_PARTITION = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def check_deepspeed() -> None:
    """Fail early, with a version message, if this DeepSpeed lacks a seam ds_odc relies on."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    version = Version(deepspeed.__version__.split("+")[0])
    missing = [
        name for owner, name in [
            (Stage3, AVG_SCATTER_GRADS),
            (Stage3, "_set_fp16_partitioned_groups_flat"),
            (Stage3, "partition_grads"),
            (Stage3, "initialize_ds_offload"),
            (Stage3, "_post_step"),
            (DeepSpeedEngine, "_configure_zero_optimizer"),
            (coordinator_module, "assert_ints_same_as_other_ranks"),
        ] if not hasattr(owner, name)
    ]
    if missing or not (_MIN <= version < _MAX):
        raise ImportError(f"ds_odc supports deepspeed{SUPPORTED}; found {deepspeed.__version__}"
                          + (f", which lacks {missing}" if missing else "") +
                          ". Install a supported version: pip install 'deepspeed>=0.19.8,<0.20'")


def install_config_model(config_cls) -> None:
    """Why: ``get_zero_config`` builds the module-global ``DeepSpeedZeroConfig`` (extra="forbid"), so the ``odc`` key
    is accepted only once that global is our subclass; ``zero.Init`` parses the same config, hence at import."""
    from deepspeed.runtime.zero import config as zero_config_module
    zero_config_module.DeepSpeedZeroConfig = config_cls


def install_optimizer_hook(optimizer_cls, prepare) -> None:
    """Why: the engine imports ``DeepSpeedZeroOptimizer_Stage3`` by name at call time, so rebinding that name, only
    while an ODC engine builds its optimizer, swaps in our subclass without leaking into other engines."""
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.zero import stage3

    original = engine_module.DeepSpeedEngine._configure_zero_optimizer
    if getattr(original, "_ds_odc_hook", False):
        return

    @functools.wraps(original)
    def _configure_zero_optimizer(engine, optimizer):
        odc = getattr(engine._config.zero_config, "odc", None)
        if odc is None or not odc.enabled:
            return original(engine, optimizer)
        if not prepare(engine, optimizer):  # validates, and returns False when ODC has nothing to do
            return original(engine, optimizer)
        stock = stage3.DeepSpeedZeroOptimizer_Stage3
        stage3.DeepSpeedZeroOptimizer_Stage3 = optimizer_cls
        try:
            return original(engine, optimizer)
        finally:
            stage3.DeepSpeedZeroOptimizer_Stage3 = stock

    _configure_zero_optimizer._ds_odc_hook = True
    engine_module.DeepSpeedEngine._configure_zero_optimizer = _configure_zero_optimizer


@contextlib.contextmanager
def no_rank_consistency_asserts():
    """Why: the coordinator's ``reset_step`` compares its recorded module trace across ranks with collectives
    (``assert_ints_same_as_other_ranks``); with ODC ranks run different microbatches, so it would deadlock."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    stock = coordinator_module.assert_ints_same_as_other_ranks
    coordinator_module.assert_ints_same_as_other_ranks = lambda *args, **kwargs: None
    try:
        yield
    finally:
        coordinator_module.assert_ints_same_as_other_ranks = stock


def grad_partition_map(optimizer) -> dict:
    """Why: stage 3 keeps ``{ds_id: view of grad_partitions_flat_buffer}`` in a name-mangled dict that ``step`` reads;
    ODC re-homes that buffer into transport memory and must re-point the views."""
    return getattr(optimizer, PARAM_ID_TO_GRAD_PARTITION)


def bind_param_gathers(param, gather_coalesced, gather) -> None:
    """Why: ``zero.Init`` binds per-parameter closures ``all_gather_coalesced`` (used by the coordinator for every fetch
    and prefetch) and ``all_gather`` (external params, ``GatheredParameters``); both are collectives, so ODC rebinds
    them to one-sided reads (the pattern MiCS used before 0.19.8)."""
    param.all_gather_coalesced = gather_coalesced
    param.all_gather = gather


def use_coordinator_class(offload, coordinator_cls) -> None:
    """Why: ``DeepSpeedZeRoOffload`` constructs its ``PartitionedParameterCoordinator`` inside its ``__init__``, with no
    factory to override, so ODC re-classes the instance it built."""
    offload.param_coordinator.__class__ = coordinator_cls


class Stage3Seams:
    """The private stage-3 methods ODC overrides. Each forwards to a public ``odc_*`` hook of the ODC optimizer."""

    def _set_fp16_partitioned_groups_flat(self):
        # Why: right after ``lp_param_buffer`` (all trainable shards, flat) is built and before anything aliases it,
        # so the shards can move into symmetric memory that peers read.
        self.odc_place_trainable_shards()
        super()._set_fp16_partitioned_groups_flat()

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params, communication_data_type):
        # Why: this is where stage 3 reduce-scatters each gradient bucket; ODC pushes the slices to their owners.
        return self.odc_push_grads(params)

    def _post_step(self, timer_names):
        # Why: stock re-gathers persistent params here, after the update; peers must have published theirs first.
        self.odc_publish_update()
        super()._post_step(timer_names)
