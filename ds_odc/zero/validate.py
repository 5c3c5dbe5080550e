"""Configurations ODC cannot run, rejected at ``deepspeed.initialize`` with the option to change.

ODC needs every trainable shard and the gradient accumulator in one device buffer per rank (so no parameter offload;
the optimizer may live on the host: ``offload_optimizer`` with ``device: "cpu"``), gathers and pushes over the plain
data-parallel group or, with ``odc.shard_size``, over shard groups that split it evenly (no hpZ, TP, SP, PP, MoE
groups), and no per-bucket collectives on the gradient path.

Two kinds of rules, one owner. :data:`CONFIG_RULES` decide from the ds_config alone, so ``python -m ds_odc check``
runs them on a file (:func:`config_problems`) and ``deepspeed.initialize`` runs the very same ones on the engine's
config before the rules that need the job itself (:data:`CHECKED_AT_INITIALIZE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.utils import logger

__all__: list[str] = []

CHECKED_AT_INITIALIZE = ("zero_optimization.odc.shard_size against the number of ranks, model parallelism (pipeline, "
                         "sequence parallel groups, MoE expert groups, an mpu), a Muon optimizer passed to "
                         "deepspeed.initialize, and a model partitioned by zero.Init over another group")
"""What only ``deepspeed.initialize`` can refuse: it depends on the job, the model or the optimizer object."""


@dataclass(frozen=True)
class ConfigRule:
    """One configuration ODC refuses, decided from the parsed ds_config (a ``DeepSpeedConfig``) alone."""

    refusal: Callable[[object], Optional[ValueError]]
    """The error naming the option to change, or None when the config passes."""
    examples: tuple[dict, ...]
    """ds_config fragments this rule refuses, each merged into a stage-3 ODC config (the tests plant them)."""


CONFIG_RULES: list[ConfigRule] = []


def _rule(*examples: dict):
    def register(refusal):
        CONFIG_RULES.append(ConfigRule(refusal, examples))
        return refusal
    return register


def _reject(option: str, why: str) -> ValueError:
    return ValueError(f"ds_odc: {option} is not supported with zero_optimization.odc ({why}). "
                      f"Change {option} or turn ODC off.")


def read_config(ds_config: dict):
    """``ds_config`` (a dict) parsed as ``deepspeed.initialize`` parses it, into the ``DeepSpeedConfig`` the rules
    read, outside a job: every section is validated (pydantic's ValidationError names a bad key), only the batch
    sizes are not checked against the number of ranks, which a file does not say."""
    from ds_odc.zero._deepspeed_privates import config_outside_a_job
    return config_outside_a_job(ds_config)


def config_problems(config) -> list[ValueError]:
    """Every refusal that ``config`` (a ``DeepSpeedConfig`` with ODC on) earns from :data:`CONFIG_RULES`, in order."""
    return [error for rule in CONFIG_RULES if (error := rule.refusal(config)) is not None]


def config_warnings(config) -> list[str]:
    """Options of ``config`` that ODC accepts and ignores."""
    zc = config.zero_config
    if zc.use_all_reduce_for_fetch_params or zc.allgather_sequential:
        return ["ds_odc: stage3_use_all_reduce_for_fetch_params / stage3_allgather_sequential are ignored: ODC "
                "replaces parameter fetching"]
    return []


def validate_engine(engine, optimizer) -> bool:
    """Raise ValueError naming the first unsupported option of an engine that asked for ODC.

    Returns False when ODC has nothing to do (no optimizer: inference), True when it applies."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.utils import DummyOptim
    from deepspeed import comm as dist
    from deepspeed.utils import groups

    problems = config_problems(engine._config)
    if problems:
        raise problems[0]
    for warning in config_warnings(engine._config):
        logger.warning(warning)
    if type(engine).__name__ == "PipelineEngine":
        raise _reject("pipeline parallelism", "ODC shards over the data-parallel group only")
    if dist.is_initialized() and groups._get_sequence_parallel_world_size() > 1:
        raise _reject("sequence_parallel_size", "ODC shards over the data-parallel group only")
    if engine.has_moe_layers:
        raise _reject("MoE expert groups", "ODC shards over the data-parallel group only")
    if isinstance(optimizer, MuonWithAuxAdam):
        raise _reject("the Muon optimizer", _MUON)
    if engine.mpu is not None:
        raise _reject("mpu (model parallelism)", "ODC shards over the data-parallel group only")
    if optimizer is None or isinstance(optimizer, DummyOptim):
        _say_stock_without_an_optimizer(engine)
        return False
    zc = engine._config.zero_config
    if zc.odc.shard_size is not None:
        _validate_shard_groups(engine, zc.odc)
    return True


def _say_stock_without_an_optimizer(engine) -> None:
    """An engine built without an optimizer is for inference (TRL's reference model, say, beside a policy that does
    train under ODC): nothing is wrong, so one line on rank 0 (once per model class) naming it, not a warning."""
    from deepspeed.utils.logging import log_dist_once
    model = type(getattr(engine, "module", None)).__name__
    log_dist_once(f"ds_odc: the engine of this {model} has no optimizer (an inference or reference model), so it "
                  "runs as stock ZeRO-3: ODC applies to engines that train", ranks=[0])


# -- the rules a ds_config alone decides, in the order they are reported -------------------------------------------
@_rule({"zero_optimization": {"stage": 2}})
def _stage(config):
    if config.zero_optimization_stage != 3:
        return _reject(f"zero_optimization.stage={config.zero_optimization_stage}",
                       "ODC extends ZeRO stage 3 only; set stage to 3")


@_rule({"zero_optimization": {"offload_param": {"device": "cpu"}}})
def _offload_param(config):
    """``offload_param`` never: peers read shards from device memory."""
    param = config.zero_config.offload_param
    if param is not None and param.device != OffloadDeviceEnum.none:
        return ValueError(
            "ds_odc: zero_optimization.offload_param is not supported with zero_optimization.odc: under ODC every "
            "rank reads the other ranks' parameter shards one-sidedly, at any moment of their forward and backward, "
            "straight from the owner's device memory (the owner takes no part in a read, so it cannot bring its "
            "shard back from the host first). To fit a larger model, put the optimizer on the host with "
            "zero_optimization.offload_optimizer {\"device\": \"cpu\"} (fp32 master weights and optimizer state "
            "leave the GPU; the bf16 shards and the gradient accumulator stay), and shard over as many ranks as "
            "possible: leave zero_optimization.odc.shard_size unset (every rank) or make it larger.")


@_rule({"zero_optimization": {"offload_optimizer": {"device": "cpu", "super_offload": True}}})
def _super_offload(config):
    if getattr(config.zero_config.offload_optimizer, "super_offload", False):
        return _reject("zero_optimization.offload_optimizer.super_offload", "SuperOffload replaces the stage-3 "
                       "optimizer ODC extends; offload_optimizer {\"device\": \"cpu\"} without it is supported")


@_rule({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent"}}})
def _offload_optimizer_to_nvme(config):
    optimizer = config.zero_config.offload_optimizer
    if optimizer is not None and optimizer.device == OffloadDeviceEnum.nvme:
        return _reject("zero_optimization.offload_optimizer.device=nvme", "the optimizer state can live in CPU "
                       "memory under ODC, not on NVMe; set offload_optimizer.device to \"cpu\"")


@_rule({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
def _partial_optimizer_offload(config):
    optimizer = config.zero_config.offload_optimizer
    if optimizer is not None and optimizer.device != OffloadDeviceEnum.none and optimizer.ratio != 1.0:
        return _reject(f"zero_optimization.offload_optimizer.ratio={optimizer.ratio}", "partial optimizer offload "
                       "is not supported; use ratio 1.0 (every sub-group on the CPU)")


@_rule({"zero_optimization": {"zero_hpz_partition_size": 2}})
def _hpz(config):
    if config.zero_config.zero_hpz_partition_size > 1:
        return _reject("zero_optimization.zero_hpz_partition_size", "hpZ secondary shards use another group; "
                       "zero_optimization.odc.shard_size keeps every read inside a node instead")


QUANTIZED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")


@_rule(*({"zero_optimization": {name: True}} for name in QUANTIZED))
def _quantized(config):
    for name in QUANTIZED:
        if getattr(config.zero_config, name):
            return _reject(f"zero_optimization.{name}", "ZeRO++ quantized communication is collective")


@_rule({"zero_optimization": {"reduce_scatter": False}})
def _all_reduce_gradients(config):
    if not config.zero_config.reduce_scatter:
        return _reject("zero_optimization.reduce_scatter=false", "the all-reduce gradient path bypasses ODC's push")


@_rule({"gradient_predivide_factor": 2.0})
def _predivide(config):
    if config.gradient_predivide_factor != 1.0:
        return _reject("gradient_predivide_factor", "ODC averages by the data-parallel size")


@_rule({"zero_optimization": {"stage3_module_granularity_threshold": 100}})
def _module_granularity(config):
    if config.zero_config.module_granularity_threshold > 0:
        return _reject("zero_optimization.stage3_module_granularity_threshold", "fast leaf fetching is collective")


@_rule({"zero_optimization": {"enable_sanity_checks": True}})
def _sanity_checks(config):
    if config.zero_config.enable_sanity_checks:
        return _reject("zero_optimization.enable_sanity_checks", "it adds a collective per gradient bucket")


@_rule({"zero_optimization": {"zenflow": {}}})
def _zenflow(config):
    if config.zero_config.zenflow is not None:
        return _reject("zero_optimization.zenflow", "it hooks the gradient reduce path")


@_rule({"fp16": {"enabled": True}})
def _fp16(config):
    if config.float16_config.enabled:
        return _reject("fp16.enabled", "dynamic loss scaling is not supported yet; use bf16 or fp32")


@_rule({"compile": {"deepcompile": True}})
def _deepcompile(config):
    if config.compile_config.deepcompile:
        return _reject("compile.deepcompile", "DeepCompile replaces the ZeRO-3 hooks ODC extends")


@_rule({"tensor_parallel": {"autotp_size": 2}})
def _autotp(config):
    if config.tensor_parallel_config.autotp_size > 1:
        return _reject("tensor_parallel.autotp_size", "ODC shards over the data-parallel group only")


@_rule({"activation_checkpointing": {"partition_activations": True}})
def _partitioned_activations(config):
    if config.activation_checkpointing_config.partition_activations:
        return _reject("activation_checkpointing.partition_activations", "it issues model-parallel collectives")


_MUON = "its step-time all-gathers are untested with ODC"


@_rule({"optimizer": {"type": "Muon", "params": {"lr": 0.01, "torch_adam": True}}})  # torch_adam: no FusedAdam JIT
def _muon_by_name(config):
    from deepspeed.runtime.config import MUON_OPTIMIZER
    if config.optimizer_name == MUON_OPTIMIZER:
        return _reject("the Muon optimizer", _MUON)


# -- rules that need the job -----------------------------------------------------------------------------------------
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
