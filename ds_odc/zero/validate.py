"""Configurations ODC cannot run, rejected at ``deepspeed.initialize`` with the option to change.

ODC needs every trainable shard and the gradient accumulator in one device buffer per rank (so no parameter offload;
the optimizer may live on the host: ``offload_optimizer`` with ``device: "cpu"``), gathers and pushes over the plain
data-parallel group or, with ``odc.shard_size``, over shard groups that split it evenly (no hpZ, TP, SP, PP, MoE
groups), and no per-bucket collectives on the gradient path.
"""

from __future__ import annotations

from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.utils import logger

__all__ = ["validate_engine"]


def _reject(option: str, why: str) -> ValueError:
    return ValueError(f"ds_odc: {option} is not supported with zero_optimization.odc ({why}). "
                      f"Change {option} or turn ODC off.")


def validate_engine(engine, optimizer) -> bool:
    """Raise ValueError naming the first unsupported option of an engine that asked for ODC.

    Returns False when ODC has nothing to do (no optimizer: inference), True when it applies."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.utils import DummyOptim
    from deepspeed import comm as dist
    from deepspeed.utils import groups

    zc = engine._config.zero_config
    if engine.zero_optimization_stage() != 3:
        raise _reject(f"zero_optimization.stage={engine.zero_optimization_stage()}", "ODC extends ZeRO stage 3 only; set stage to 3")
    _validate_offload(engine, zc)
    if zc.zero_hpz_partition_size > 1:
        raise _reject("zero_optimization.zero_hpz_partition_size", "hpZ secondary shards use another group; "
                      "zero_optimization.odc.shard_size keeps every read inside a node instead")
    for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        if getattr(zc, name):
            raise _reject(f"zero_optimization.{name}", "ZeRO++ quantized communication is collective")
    if not zc.reduce_scatter:
        raise _reject("zero_optimization.reduce_scatter=false", "the all-reduce gradient path bypasses ODC's push")
    if engine.gradient_predivide_factor() != 1.0:
        raise _reject("gradient_predivide_factor", "ODC averages by the data-parallel size")
    if zc.module_granularity_threshold > 0:
        raise _reject("zero_optimization.stage3_module_granularity_threshold", "fast leaf fetching is collective")
    if zc.enable_sanity_checks:
        raise _reject("zero_optimization.enable_sanity_checks", "it adds a collective per gradient bucket")
    if zc.zenflow is not None:
        raise _reject("zero_optimization.zenflow", "it hooks the gradient reduce path")
    if engine.fp16_enabled():
        raise _reject("fp16.enabled", "dynamic loss scaling is not supported yet; use bf16 or fp32")
    if engine.is_deepcompile_enabled():
        raise _reject("compile.deepcompile", "DeepCompile replaces the ZeRO-3 hooks ODC extends")
    if type(engine).__name__ == "PipelineEngine":
        raise _reject("pipeline parallelism", "ODC shards over the data-parallel group only")
    if engine.autotp_size() > 1:
        raise _reject("tensor_parallel.autotp_size", "ODC shards over the data-parallel group only")
    if dist.is_initialized() and groups._get_sequence_parallel_world_size() > 1:
        raise _reject("sequence_parallel_size", "ODC shards over the data-parallel group only")
    if engine.has_moe_layers:
        raise _reject("MoE expert groups", "ODC shards over the data-parallel group only")
    if engine._config.activation_checkpointing_config.partition_activations:
        raise _reject("activation_checkpointing.partition_activations", "it issues model-parallel collectives")
    if isinstance(optimizer, MuonWithAuxAdam):
        raise _reject("the Muon optimizer", "its step-time all-gathers are untested with ODC")
    if zc.use_all_reduce_for_fetch_params or zc.allgather_sequential:
        logger.warning("ds_odc: stage3_use_all_reduce_for_fetch_params / stage3_allgather_sequential are ignored: "
                       "ODC replaces parameter fetching")
    if engine.mpu is not None:
        raise _reject("mpu (model parallelism)", "ODC shards over the data-parallel group only")
    if optimizer is None or isinstance(optimizer, DummyOptim):
        logger.warning("ds_odc: no optimizer was given, so there is no training step: ODC is not used")
        return False
    if zc.odc.shard_size is not None:
        _validate_shard_groups(engine, zc.odc)
    return True


def _validate_shard_groups(engine, odc) -> None:
    """``shard_size`` must split the job evenly (ValueError from ``groups_for``), and a model partitioned before
    ``deepspeed.initialize`` (under ``zero.Init``) must be partitioned over this rank's shard group."""
    from deepspeed import comm as dist
    from ds_odc.zero.hybrid import groups_for, same_ranks
    groups = groups_for(odc)  # collective: every rank validates the same config at the same point
    shard_ranks = list(range(dist.get_world_size())) if groups is None else groups.layout.shard_group_ranks()
    for name, param in engine.module.named_parameters():
        if hasattr(param, "ds_id") and not same_ranks(getattr(param, "ds_process_group", None), shard_ranks):
            size = dist.get_world_size(group=param.ds_process_group)
            raise ValueError(f"ds_odc: zero_optimization.odc.shard_size={odc.shard_size}: parameter {name} was "
                             f"partitioned by deepspeed.zero.Init over {size} ranks, not over its shard group of "
                             f"{len(shard_ranks)}. Build the model under deepspeed.zero.Init(config_dict_or_path="
                             "ds_config) with ds_odc imported (the config's odc.shard_size picks the group), or "
                             "without zero.Init.")


def _validate_offload(engine, zc) -> None:
    """``offload_param`` never (peers read shards from device memory); ``offload_optimizer`` to the CPU, whole."""
    param = zc.offload_param
    if param is not None and param.device != OffloadDeviceEnum.none:
        raise ValueError(
            "ds_odc: zero_optimization.offload_param is not supported with zero_optimization.odc: under ODC every "
            "rank reads the other ranks' parameter shards one-sidedly, at any moment of their forward and backward, "
            "straight from the owner's device memory (the owner takes no part in a read, so it cannot bring its "
            "shard back from the host first). To fit a larger model, put the optimizer on the host with "
            "zero_optimization.offload_optimizer {\"device\": \"cpu\"} (fp32 master weights and optimizer state "
            "leave the GPU; the bf16 shards and the gradient accumulator stay), and shard over as many ranks as "
            "possible: leave zero_optimization.odc.shard_size unset (every rank) or make it larger.")
    if engine.super_offload():
        raise _reject("zero_optimization.offload_optimizer.super_offload", "SuperOffload replaces the stage-3 "
                      "optimizer ODC extends; offload_optimizer {\"device\": \"cpu\"} without it is supported")
    optimizer = zc.offload_optimizer
    if optimizer is None or optimizer.device == OffloadDeviceEnum.none:
        return
    if optimizer.device == OffloadDeviceEnum.nvme:
        raise _reject("zero_optimization.offload_optimizer.device=nvme", "the optimizer state can live in CPU "
                      "memory under ODC, not on NVMe; set offload_optimizer.device to \"cpu\"")
    if optimizer.ratio != 1.0:
        raise _reject(f"zero_optimization.offload_optimizer.ratio={optimizer.ratio}", "partial optimizer offload is "
                      "not supported; use ratio 1.0 (every sub-group on the CPU)")
