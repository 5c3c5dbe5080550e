"""The register of every DeepSpeed internal ds_odc touches: their names, the version check, the installers, and the
overrides of private members.

Supported: ``deepspeed>=0.19.8,<0.20``. :func:`check_deepspeed` feature-detects each symbol at import, so a DeepSpeed
that moved one fails with a version message, never a hang. Each installer, accessor and override says in one line
why it exists. The overrides (:class:`Stage3Seams`, :class:`CoordinatorSeams`) hold no logic: each forwards in a
few lines to a collaborator the seam class names and this module imports, the engine's
:class:`~ds_odc.zero.state.OdcState` (``self.odc``), the optimizer's :class:`~ds_odc.zero.host_step.HostStep` or
:func:`~ds_odc.zero.norms.gradient_norms`, never to a method of the classes that derive from them
(:class:`~ds_odc.zero.optimizer.OdcOptimizer`, :class:`~ds_odc.zero.coordinator.OdcParamCoordinator`; see
[Note: seams call down]).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import weakref

import deepspeed
from packaging.version import Version

from ds_odc.zero.host_step import HostStep
from ds_odc.zero.norms import gradient_norms
from ds_odc.zero.state import OdcState

__all__: list[str] = []

SUPPORTED = ">=0.19.8,<0.20"
_MIN, _MAX = Version("0.19.8"), Version("0.20")

# Name-mangled members of DeepSpeed classes that ODC overrides or reads.
AVG_SCATTER_GRADS = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
PARAM_ID_TO_GRAD_PARTITION = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
COORDINATOR_GATHER = "_PartitionedParameterCoordinator__all_gather_params_"
_COORD = "_PartitionedParameterCoordinator__"
COORDINATOR_COUNT = _COORD + "n_available_params"
COORDINATOR_STREAM = _COORD + "allgather_stream"
COORDINATOR_IN_FLIGHT = _COORD + "inflight_param_registry"
COORDINATOR_RELEASE = _COORD + "release_param"


def check_deepspeed() -> None:
    """Fail early, with a version message, if this DeepSpeed lacks a seam ds_odc relies on."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    version = Version(deepspeed.__version__.split("+")[0])
    Coordinator = coordinator_module.PartitionedParameterCoordinator
    missing = [
        name for owner, name in [
            (Stage3, AVG_SCATTER_GRADS),
            (Stage3, "_set_fp16_partitioned_groups_flat"),
            (Stage3, "partition_grads"),
            (Stage3, "initialize_ds_offload"),
            (Stage3, "_post_step"),
            (Stage3, "_get_fp32_grad_state_partition"),
            (Stage3, "update_fp32_grad_for_param_vectorized"),
            (Stage3, "_partition_all_parameters"),
            (Stage3, "_get_norm_groups"),
            (Stage3, "has_overflow"),
            (Stage3, "has_overflow_partitioned_grads_serial"),
            (Stage3, "get_fp32_grad_partitions"),
            (Stage3, "set_fp32_grad_for_param"),
            (Stage3, "set_local_grad_for_param"),
            (Stage3, "_get_param_partition_group"),
            (Stage3, "_prepare_sub_group"),
            (Stage3, "_reassign_or_swap_out_partitioned_parameters"),
            (Stage3, "independent_gradient_partition_epilogue"),
            (Coordinator, COORDINATOR_GATHER),
            (Coordinator, "reset_step"),
            (Coordinator, "fetch_sub_module"),
            (Coordinator, "release_sub_module"),
            (DeepSpeedEngine, "_configure_zero_optimizer"),
            (DeepSpeedEngine, "_configure_checkpointing"),
            (DeepSpeedEngine, "deepspeed_io"),
            (DeepSpeedConfig, "_initialize_params"),
            (coordinator_module, "assert_ints_same_as_other_ranks"),
            (coordinator_module, "iter_params"),
        ] if not hasattr(owner, name)
    ]
    if missing or not (_MIN <= version < _MAX):
        raise ImportError(f"ds_odc supports deepspeed{SUPPORTED}; found {deepspeed.__version__}"
                          + (f", which lacks {missing}" if missing else "") +
                          ". Install a supported version: pip install 'deepspeed>=0.19.8,<0.20'")


def skip_cpu_shm_op_build() -> None:
    """Why: on DeepSpeed's CPU accelerator ``init_distributed`` JIT-builds its shared-memory op (40 s to 3 minutes of
    g++ on first use, per torch extensions folder), which only ``inference_all_reduce`` uses, never ZeRO training;
    without it ``inference_all_reduce`` takes ``torch.distributed.all_reduce`` (``TorchBackend`` then has no
    ``shm_vector_kernel_level``). Called by :func:`ds_odc.patch`, so a usual script that imports ds_odc and calls
    ``deepspeed.init_distributed`` skips it too. Through sys.modules: ``import deepspeed.comm.torch as m`` binds the
    torch package that ``deepspeed.comm`` re-exports, and patching that would silently do nothing."""
    import sys

    import deepspeed.comm  # noqa: F401  (loads deepspeed.comm.torch)
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() == "cpu":
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def config_outside_a_job(ds_config: dict):
    """Why: ``DeepSpeedConfig(ds_config)`` also checks the batch sizes against the number of ranks, which a config
    read outside a job (``python -m ds_odc check``) does not know; ``_initialize_params`` parses every section as
    ``deepspeed.initialize`` does, and only the batch arithmetic is left out."""
    import copy

    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig.__new__(DeepSpeedConfig)
    config._param_dict, config.global_rank, config.world_size = ds_config, 0, 1
    config._initialize_params(copy.copy(ds_config))
    return config


# -- installing ODC -------------------------------------------------------------------------------------------------
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
            built = original(engine, optimizer)
        finally:
            stage3.DeepSpeedZeroOptimizer_Stage3 = stock
        if isinstance(built, optimizer_cls):
            built.odc.accumulation = accumulation_of(engine)
        return built

    _configure_zero_optimizer._ds_odc_hook = True
    engine_module.DeepSpeedEngine._configure_zero_optimizer = _configure_zero_optimizer


def install_zero_init_group(shard_group_for) -> None:
    """Why: ``zero.Init`` partitions over the world unless given ``data_parallel_group``, and DeepSpeed partitions a
    model built without it through the same ``Init`` with no group
    (``DeepSpeedZeRoOffload._convert_to_zero_parameters``); so that ``odc.shard_size`` decides the group wherever DeepSpeed partitions (as MiCS's key did before 0.19.8
    removed it), ``Init`` takes its default group from the config it is given. ``shard_group_for(config, mpu)``
    returns the group, or None to keep stock's."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init.__init__
    if getattr(original, "_ds_odc_hook", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        given = bound.arguments
        config = given.get("config_dict_or_path")
        config = given.get("config") if config is None else config
        if (config is not None and given.get("enabled", True) and given.get("data_parallel_group") is None
                and given.get("sequence_data_parallel_group") is None):
            group = shard_group_for(config, given.get("mpu"))
            if group is not None:
                given["data_parallel_group"] = group
        original(*bound.args, **bound.kwargs)

    __init__._ds_odc_hook = True
    Init.__init__ = __init__


def partition_over(optimizer_kwargs: dict, group) -> None:
    """Why: the engine hands the stage-3 optimizer the whole data-parallel group (``dp_process_group``), which sizes
    its partitions, norms and checkpoint files; with hybrid sharding those belong to the shard group, while the engine
    keeps the whole group for its batch-size arithmetic."""
    optimizer_kwargs["dp_process_group"] = group


def install_checkpoint_writers(is_replica) -> None:
    """Why: under ZeRO-3 every rank writes ``zero_pp_rank_<p>_..._model_states.pt``, named by its rank in the
    optimizer's group (``_configure_checkpointing`` sets ``save_non_zero_checkpoint``); with hybrid sharding the
    replicas of a shard would write the same file at once, so only the first shard group writes (its optimizer-state
    files are already the only ones written: DeepSpeed writes them where that rank equals the data-parallel rank).
    ``is_replica(engine)`` says whether this rank holds a copy another group also writes."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_checkpointing
    if getattr(original, "_ds_odc_hook", False):
        return

    @functools.wraps(original)
    def _configure_checkpointing(engine):
        original(engine)
        if is_replica(engine):
            engine.save_non_zero_checkpoint = False

    _configure_checkpointing._ds_odc_hook = True
    DeepSpeedEngine._configure_checkpointing = _configure_checkpointing


def install_planned_loop(make_loader) -> None:
    """Why: ``deepspeed.initialize(training_data=...)`` builds its training loader with ``DeepSpeedEngine.deepspeed_io``
    and the stock loop's ``backward`` and accumulation boundary follow the configured ``gradient_accumulation_steps``;
    with ``zero_optimization.odc.balancer`` the loader is ``make_loader(engine, dataset, collate_fn)`` instead, and the
    engine follows the plan it attaches (:mod:`ds_odc.zero.planned`): ``backward`` weighs the loss by the current
    microbatch's weight (not 1/gradient_accumulation_steps), ``step`` at the plan's boundary tells the plan (which
    measures the step there), and the batch-size questions answer for the plan."""
    from deepspeed.runtime.engine import ROUTE_TRAIN, DeepSpeedEngine

    from ds_odc.zero.planned import check_balancer_read, plan_of

    if getattr(DeepSpeedEngine.deepspeed_io, "_ds_odc_hook", False):
        return
    stock_io = DeepSpeedEngine.deepspeed_io
    stock_backward = DeepSpeedEngine.backward
    stock_gas = DeepSpeedEngine.gradient_accumulation_steps
    stock_micro = DeepSpeedEngine.train_micro_batch_size_per_gpu
    stock_batch = DeepSpeedEngine.train_batch_size
    stock_step = DeepSpeedEngine.step

    def balancer_of(engine):
        return getattr(getattr(engine._config.zero_config, "odc", None), "balancer", None)

    @functools.wraps(stock_io)
    def deepspeed_io(engine, dataset, batch_size=None, route=ROUTE_TRAIN, pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):
        balancer = balancer_of(engine)
        if balancer is None or route != ROUTE_TRAIN or data_sampler is not None:
            return stock_io(engine, dataset, batch_size, route, pin_memory, data_sampler, collate_fn,
                            num_local_io_workers)
        return make_loader(engine, dataset, collate_fn if collate_fn is not None else engine.collate_fn)

    @functools.wraps(stock_backward)
    def backward(engine, loss, retain_graph=False, scale_wrt_gas=True):
        plan = plan_of(engine)
        if plan is None or plan.current is None:
            return stock_backward(engine, loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        weighted = stock_backward(engine, plan.weigh(loss), retain_graph=retain_graph, scale_wrt_gas=False)
        plan.backward_ended()
        return weighted

    @functools.wraps(stock_step)
    def step(engine, lr_kwargs=None):
        check_balancer_read(engine, balancer_of)
        plan = plan_of(engine)
        boundary = plan is not None and plan.current is not None and plan.current.boundary
        result = stock_step(engine, lr_kwargs)
        if boundary:
            plan.stepped()
        return result

    @functools.wraps(stock_gas)
    def gradient_accumulation_steps(engine):
        plan = plan_of(engine)
        return stock_gas(engine) if plan is None or plan.current is None else plan.current.count

    @functools.wraps(stock_micro)
    def train_micro_batch_size_per_gpu(engine):
        plan = plan_of(engine)
        return stock_micro(engine) if plan is None or plan.current is None else plan.current.samples

    @functools.wraps(stock_batch)
    def train_batch_size(engine):
        plan = plan_of(engine)
        return stock_batch(engine) if plan is None else plan.minibatch_samples

    for name, method in [("deepspeed_io", deepspeed_io), ("backward", backward), ("step", step),
                         ("gradient_accumulation_steps", gradient_accumulation_steps),
                         ("train_micro_batch_size_per_gpu", train_micro_batch_size_per_gpu),
                         ("train_batch_size", train_batch_size)]:
        method._ds_odc_hook = True
        setattr(DeepSpeedEngine, name, method)


def nvtx_ranges_only_under_a_tool() -> None:
    """Why: DeepSpeed wraps its per-parameter and per-module hook functions in NVTX ranges (``instrument_w_nvtx``,
    on unless ``deepspeed.utils.nvtx.enable_nvtx`` is False), thousands of calls per microbatch that cost host time
    on a GPU even with no profiler attached to record them. A tool that records NVTX (Nsight Systems, Nsight
    Compute) announces itself through ``NVTX_INJECTION64_PATH``; then the ranges stay on."""
    import os

    from deepspeed.utils import nvtx
    if not os.environ.get("NVTX_INJECTION64_PATH"):
        nvtx.enable_nvtx = False


_MODULE_PARAMETERS = weakref.WeakKeyDictionary()  # an ODC engine's module -> (its own parameters, its subtree's)


def list_module_parameters_once(model) -> None:
    """Why: the coordinator lists a module's parameters (``iter_params``: for a transformer block, a walk of all its
    submodules) several times per fetch and release, for every block of every microbatch; parameters do not change
    after ``deepspeed.initialize``, so for an ODC engine's modules they are listed once (external parameters, which
    a forward may register, are still read live). Other engines' modules take stock's walk."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    stock = coordinator_module.iter_params
    if not getattr(stock, "_ds_odc_hook", False):
        def iter_params(module, recurse=False):
            listed = _MODULE_PARAMETERS.get(module)
            if listed is None:
                return stock(module, recurse)
            return itertools.chain(listed[bool(recurse)], (p for _, p in module.ds_external_parameters()))

        iter_params._ds_odc_hook = True
        coordinator_module.iter_params = iter_params
    for module in model.modules():
        _MODULE_PARAMETERS[module] = (tuple(p for _, p in module.named_parameters(recurse=False)),
                                      tuple(p for _, p in module.named_parameters(recurse=True)))


def holds_parameters(module) -> bool:
    """Whether the coordinator fetches parameters for ``module`` of an ODC engine's model: a block (a ZeRO-3 leaf
    module, whose whole subtree is fetched at once) or, outside blocks, a module with parameters of its own. Read off
    the lists :func:`list_module_parameters_once` made, so the answer depends on the model alone."""
    from deepspeed.utils import z3_leaf_module
    return bool(_MODULE_PARAMETERS[module][bool(z3_leaf_module(module))])


def accumulation_of(engine):
    """Why: whether the caller owns the accumulation boundary is engine state (``_is_gradient_accumulation_boundary``
    is None unless set explicitly), and ODC needs it to tell a drop-in loop from one with uneven counts."""
    ref = weakref.ref(engine)

    def accumulation() -> tuple[str, bool]:
        eng = ref()
        if eng is None or not eng.managed_gradient_accumulation():
            return "unmanaged", False
        mode = "implicit" if eng._is_gradient_accumulation_boundary is None else "explicit"
        return mode, bool(eng.is_gradient_accumulation_boundary())

    return accumulation


def use_coordinator_class(offload, coordinator_cls, state) -> None:
    """Why: ``DeepSpeedZeRoOffload`` constructs its ``PartitionedParameterCoordinator`` inside its ``__init__``, with no
    factory to override, so ODC re-classes the instance it built."""
    coordinator = offload.param_coordinator
    missing = [n for n in (COORDINATOR_COUNT, COORDINATOR_STREAM, COORDINATOR_IN_FLIGHT, COORDINATOR_RELEASE)
               if not hasattr(coordinator, n)]
    if missing:
        raise ImportError(f"ds_odc supports deepspeed{SUPPORTED}: this DeepSpeed's parameter coordinator lacks "
                          f"{missing}. Install a supported version: pip install 'deepspeed>=0.19.8,<0.20'")
    coordinator.__class__ = coordinator_cls
    coordinator.odc = state


def grad_partition_map(optimizer) -> dict:
    """Why: stage 3 keeps ``{ds_id: view of grad_partitions_flat_buffer}`` in a name-mangled dict that ``step`` reads;
    ODC re-homes that buffer into transport memory and must re-point the views."""
    return getattr(optimizer, PARAM_ID_TO_GRAD_PARTITION)


def bind_param_methods(param, state) -> None:
    """Why: ``zero.Init`` binds per-parameter closures; ``all_gather`` (external params, ``GatheredParameters``, the
    persistent refresh) is a collective, so ODC reads one-sidedly instead, and ``partition(has_been_updated=True)``
    (``GatheredParameters(modifier_rank=...)`` on exit) writes shards that peers read, so ODC publishes them. The
    coordinator's release of a read parameter (``partition()``, once per parameter, block and microbatch) only drops
    the full copy: the shard never left its place (ODC rejects offload and hpZ), and stock's path there formats
    debug strings and asks for the rank several times per call."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, free_param
    stock_partition = param.partition
    available = ZeroParamStatus.AVAILABLE

    def all_gather(param_list=None, async_op=False, hierarchy=0):
        state.fetch_now([param] if param_list is None else param_list)
        return [] if async_op else None

    def partition(param_list=None, hierarchy=0, has_been_updated=False, free_data=True):
        if param_list is None and not has_been_updated and free_data and param.ds_status is available:
            free_param(param)
            return
        stock_partition(param_list=param_list, hierarchy=hierarchy, has_been_updated=has_been_updated,
                        free_data=free_data)
        if has_been_updated:
            state.publish_writes("GatheredParameters(modifier_rank=...)")

    param.all_gather = all_gather
    param.partition = partition


def forget_backward_functions(module) -> None:
    """Why: ``DeepSpeedZeRoOffload`` builds each module's backward functions (``pre_bwd_fn``, ``post_bwd_fn``) once,
    as closures over the first engine built around the module, and every later engine reuses them: an engine built
    after that one was destroyed would run its backward through the destroyed engine's coordinator. Dropped, the next
    engine builds its own."""
    for sub in module.modules():
        sub.__dict__.pop("pre_bwd_fn", None)
        sub.__dict__.pop("post_bwd_fn", None)


@contextlib.contextmanager
def zero3_hooks_detached(offload):
    """Why: DeepSpeed's module hooks fetch and release each module's parameters around every forward; while a rank
    keeps every parameter read for a whole ``generate`` call they must be off, and ``DeepSpeedZeRoOffload`` only
    removes them for good (``destroy``). Re-registering invalidates the coordinator's trace, which the next training
    forward records again (TRL's ``unwrap_model_for_generation`` does the same)."""
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        offload._register_deepspeed_module(offload.module)


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


@contextlib.contextmanager
def gradients_kept_on_device(optimizer):
    """Why: with ``offload_optimizer`` stock's gradient accessors (``safe_get/set_*_grad``,
    ``get_fp32_grad_partitions``) and its backward epilogue read the host master's ``.grad``, which it fills at every
    accumulation boundary; ODC keeps the gradients in its device accumulator until the step copies them out
    (``ds_odc.zero.host_step``), where stock without offload keeps them too, so these take stock's branch for that
    case (it tests ``offload_optimizer``)."""
    offloaded = optimizer.offload_optimizer
    optimizer.offload_optimizer = False
    try:
        yield
    finally:
        optimizer.offload_optimizer = offloaded


# What stock's offloaded step does in each phase ds_odc.zero.host_step names: its gradient copies to the host happen in
# backward (partition_grads per bucket, and the epilogue that waits for them), its CPU step in the sub-group loop.
STOCK_HOST_PHASES = {"partition_grads": "copy_out", "independent_gradient_partition_epilogue": "copy_out",
                     "unscale_and_clip_grads": "optimizer", "_optimizer_step": "optimizer",
                     "_reassign_or_swap_out_partitioned_parameters": "copy_back"}


def time_stock_host_step(optimizer, add) -> None:
    """Why: a benchmark puts stock's offloaded step beside ODC's phase by phase (copy out, CPU optimizer, copy back),
    and stock times only its whole sub-group loop. Wraps those of its methods on this instance; ``add(phase,
    seconds)`` receives the host time of each outermost call (the epilogue calls partition_grads: counted once)."""
    import time
    depth = {phase: 0 for phase in STOCK_HOST_PHASES.values()}

    def timed(method, phase):
        def call(*args, **kwargs):
            depth[phase] += 1
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                depth[phase] -= 1
                if depth[phase] == 0:
                    add(phase, time.perf_counter() - started)
        return call

    for name, phase in STOCK_HOST_PHASES.items():
        setattr(optimizer, name, timed(getattr(optimizer, name), phase))


@contextlib.contextmanager
def no_persistent_refresh(optimizer):
    """Why: stock's ``_post_step`` re-gathers the persistent parameters (``stage3_param_persistence_threshold``) from
    the owners' updated shards, which under ODC are readable only after the step's publish; so the refresh is left
    out there and done after publishing (``OdcOptimizer.step``)."""
    listed = optimizer.persistent_parameters
    optimizer.persistent_parameters = []
    try:
        yield
    finally:
        optimizer.persistent_parameters = listed


# -- the coordinator's private state, read and written by the seams below ----------------------------------------
def fetch_stream(coordinator):
    """Why: the coordinator issues its gathers on a private stream that it orders the compute stream after."""
    return getattr(coordinator, COORDINATOR_STREAM)


def count_available(coordinator, numel: int) -> None:
    """Why: the coordinator counts gathered elements privately (its prefetch budget reads the count)."""
    setattr(coordinator, COORDINATOR_COUNT, getattr(coordinator, COORDINATOR_COUNT) + numel)


def has_fetches_in_flight(coordinator) -> bool:
    """Why: the coordinator's registry of gathers still in flight is private; stock's release waits for them."""
    return bool(getattr(coordinator, COORDINATOR_IN_FLIGHT))


def release_function(coordinator):
    """Why: the coordinator releases a gathered parameter (and uncounts it) through a private method."""
    return getattr(coordinator, COORDINATOR_RELEASE)


# -- the gradient-read gate -----------------------------------------------------------------------------------------
# [Note: gradient reads]
# Stock ZeRO-3 reduce-scatters each bucket during backward, so right after backward every rank's gradient partitions
# are complete, and anything may read them: the norm (``_get_norm_groups``), the overflow check, ``safe_get_*_grad``,
# ``get_fp32_grad_partitions``. Under ODC they are complete only once every rank's pushes landed, at the step's
# fence. Every stage-3 member that reads or writes the gradient partitions from outside the step therefore goes
# through one gate, ``OdcState.settle`` (a meeting on every rank, once per minibatch; nothing when the step is on or
# nothing was pushed): :func:`reads_gradients` marks the overrides that do, and :data:`GRADIENT_STATE_WITHOUT_GATE`
# says, member by member, why the others need none. tests/zero/test_gradient_reads.py lists every member of
# DeepSpeed's stage-3 optimizer that touches gradient state and fails on one that is in neither.


def reads_gradients(why: str):
    """Mark an override of a stage-3 member that reads or writes gradient partitions: it settles this minibatch's
    pushes first (``why`` names the read in the error raised when a rank cannot take part)."""
    def decorate(method):
        @functools.wraps(method)
        def gated(self, *args, **kwargs):
            self.odc.settle(why)
            return method(self, *args, **kwargs)

        gated.gradient_read = why
        return gated

    return decorate


# Stage-3 members that touch gradient state but need no gate, and why (see [Note: gradient reads]).
GRADIENT_STATE_WITHOUT_GATE = {
    # construction, teardown and whole-buffer moves
    "__init__": "construction: nothing pushed yet",
    "_setup_for_real_optimizer": "construction: builds the buffer ODC re-homes",
    "initialize_optimizer_states": "construction",
    "_unpin_offload_buffers": "teardown (destroy)",
    "offload_states": "overridden by OdcOptimizer.offload_states, which settles before moving the accumulator",
    "reload_states": "overridden by OdcOptimizer.reload_states (after offload_states settled)",
    # the backward path, which writes the partitions: ODC pushes instead (never a meeting inside backward)
    "independent_gradient_partition_epilogue": "backward's end: lists the partitions in averaged_gradients, whose "
                                               "reads settle (OdcState.settled_on_read)",
    "partition_grads": "backward: overridden (the pushes replace it)",
    "_offload_grad_partition_at_boundary": "backward with offload_optimizer: ODC keeps gradients on the device "
                                           "(gradients_kept_on_device), so this is never reached",
    "_finalize_offload_gradient_accumulation": "as _offload_grad_partition_at_boundary",
    "set_norm_for_param_grad_in_gpu": "as _offload_grad_partition_at_boundary",
    "reset_cpu_buffers": "the step's start (after the fence)",
    "complete_grad_norm_calculation_for_cpu_offload": "only called by _get_norm_groups, which is gated and does "
                                                      "not call it under ODC",
    # the optimizer step, after its fence (settle is a no-op there)
    "step": "the step: its fence lands every push first",
    "_prepare_fp32_grad_for_sub_group": "inside the step",
    "unscale_and_clip_grads": "inside the step",
    "_release_sub_group": "inside the step",
    "_optimizer_states_and_gradient_swap_out": "inside the step (NVMe swapping, which ODC rejects)",
    "_release_swap_buffers": "inside the step or a gated accessor (NVMe swapping, which ODC rejects)",
    "_writeback_swap_state": "inside the step or a gated accessor (NVMe swapping, which ODC rejects)",
    "_overflow_clean_up": "inside the step",
    "_apply_muon_to_accumulated_grads": "inside the step (Muon, which ODC rejects)",
    "_apply_muon_updates_cpu_offload": "inside the step (Muon, which ODC rejects)",
}


# -- overrides ----------------------------------------------------------------------------------------------------
# [Note: seams call down]
# Each override below forwards, in a line or a few, to a collaborator that the seam class names and this module
# imports: the engine's OdcState (``odc``: how shards and gradients move), the optimizer's HostStep (``host_step``:
# the step on the host under offload_optimizer) or gradient_norms; what it reads of ``self`` besides is DeepSpeed's
# own (the class it overrides for: SEAM_CLASSES). No seam class calls a method that only the class deriving from it
# (OdcOptimizer, OdcParamCoordinator) defines; tests/test_layout.py checks it.
SEAM_CLASSES = {  # seam class -> (DeepSpeed module, the class whose members it overrides)
    "CoordinatorSeams": ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator"),
    "Stage3Seams": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
}


class CoordinatorSeams:
    """The private ``PartitionedParameterCoordinator`` members ODC overrides (on ``OdcParamCoordinator``)."""

    odc: OdcState  # the engine's: set by the ODC optimizer when it re-classes the coordinator (use_coordinator_class)

    def _PartitionedParameterCoordinator__all_gather_params_(self, params, forward, quantize=False):
        # Why: the coordinator's one all-gather site, for fetches and prefetches alike; it counts gathered elements.
        if quantize:
            raise RuntimeError("ds_odc: quantized parameter fetches are not supported with ODC")
        count_available(self, self.odc.fetch_missing(params, fetch_stream(self)))

    def reset_step(self) -> None:
        # Why: see no_rank_consistency_asserts.
        with no_rank_consistency_asserts():
            super().reset_step()

    def fetch_sub_module(self, current_submodule, forward: bool) -> None:
        # Why: odc.lockstep's meeting before a block's forward (forward fetches only: a backward pre-hook runs once
        # per output and concurrent duplicates return early, a count ranks need not share).
        if self.odc.lockstep and forward and holds_parameters(current_submodule):
            self.odc.meet_lockstep("the lock-step meeting before a block's forward")
        super().fetch_sub_module(current_submodule, forward)

    def release_sub_module(self, submodule, forward: bool = False) -> None:
        # Why: odc.lockstep's meeting after a block's backward (DeepSpeed's post-backward hook runs it once per call).
        super().release_sub_module(submodule, forward)
        if self.odc.lockstep and not forward and holds_parameters(submodule):
            self.odc.meet_lockstep("the lock-step meeting after a block's backward")


class Stage3Seams:
    """The ``DeepSpeedZeroOptimizer_Stage3`` members ODC overrides (on ``OdcOptimizer``, which sets the three
    attributes below; this module imports neither it nor the coordinator subclass)."""

    odc: OdcState  # how shards and gradients move: set before DeepSpeed's constructor runs
    host_step: HostStep | None = None  # with offload_optimizer: the gradients' way to the host, the parameters' back
    coordinator_class: type  # what the parameter coordinator DeepSpeed builds becomes

    def initialize_ds_offload(self, *args, **kwargs):
        # Why: the coordinator this builds performs every fetch; ODC re-classes it (see use_coordinator_class).
        offload = super().initialize_ds_offload(*args, **kwargs)
        use_coordinator_class(offload, self.coordinator_class, self.odc)
        return offload

    def _set_fp16_partitioned_groups_flat(self):
        # Why: right after ``lp_param_buffer`` (all trainable shards, flat) is built and before anything aliases it,
        # ODC moves it into symmetric memory that peers read, and routes each parameter's gathers through ODC.
        params = list(itertools.chain.from_iterable(self.fp16_groups))
        self.lp_param_buffer = self.odc.take_trainable_shards(params, self.lp_param_buffer, self.dp_process_group)
        for param in params:
            bind_param_methods(param, self.odc)
        super()._set_fp16_partitioned_groups_flat()

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params, communication_data_type):
        # Why: this is where stage 3 reduce-scatters each gradient bucket; ODC pushes the slices to their owners.
        self.odc.push(params)
        return [None] * len(params)

    def partition_grads(self, params_to_release, grad_partitions) -> list:
        # Why: stock copies (or adds) the reduce-scattered slice into the local partition; ODC pushed it already.
        self.odc.free_pushed_gradients(params_to_release)
        return []

    def _partition_all_parameters(self):
        # Why: stock walks every module twice and releases each gathered parameter through zero.Init's closures;
        # with gathers in flight (never under ODC, whose reads are waited where issued) stock's path waits for them.
        coordinator = self.parameter_offload.get_param_coordinator()
        if has_fetches_in_flight(coordinator):
            super()._partition_all_parameters()
        else:
            self.odc.release_gathered(release_function(coordinator))

    @reads_gradients("the gradient norm (optimizer._get_norm_groups)")
    def _get_norm_groups(self):
        # Why: stock takes one norm per parameter over views of what under ODC is one flat fp32 accumulator.
        norms = gradient_norms(self.fp16_groups, self.odc, grad_partition_map(self), self._get_param_partition_group,
                               on_host=self.host_step is not None)
        return super()._get_norm_groups() if norms is None else norms

    @reads_gradients("the overflow check (optimizer.has_overflow)")
    def has_overflow(self, partition_gradients=True):
        # Why: it reads the whole flat accumulator (grad_partitions_flat_buffer).
        return super().has_overflow(partition_gradients)

    @reads_gradients("the overflow check (optimizer.has_overflow_partitioned_grads_serial)")
    def has_overflow_partitioned_grads_serial(self):
        # Why: it reads averaged_gradients (settled there too; gated here so its first read is complete).
        return super().has_overflow_partitioned_grads_serial()

    @reads_gradients("reading the gradient partitions (optimizer.get_fp32_grad_partitions)")
    def get_fp32_grad_partitions(self):
        # Why: it reads averaged_gradients (and see gradients_kept_on_device).
        with gradients_kept_on_device(self):
            return super().get_fp32_grad_partitions()

    def _post_step(self, timer_names):
        # Why: see no_persistent_refresh.
        with no_persistent_refresh(self):
            super()._post_step(timer_names)

    @property
    def averaged_gradients(self):
        # Why: stage 3 and its users read gradients here between backward and step; under ODC they are complete only
        # once the pushes landed (see OdcState.settled_on_read).
        return self.__dict__["_odc_averaged_gradients"]

    @averaged_gradients.setter
    def averaged_gradients(self, value):
        self.__dict__["_odc_averaged_gradients"] = self.odc.settled_on_read(value)

    @reads_gradients("reading or writing a gradient (safe_get_*_grad / safe_set_*_grad)")
    def _get_fp32_grad_state_partition(self, param, release_swap_buffers):
        # Why: every safe_get/set_*_grad goes through here; the gradient must be complete before it is read or
        # replaced, or the fence would add the pending pushes on top of a written value (and see
        # gradients_kept_on_device).
        with gradients_kept_on_device(self):
            return super()._get_fp32_grad_state_partition(param, release_swap_buffers)

    @reads_gradients("writing a gradient (safe_set_full_grad)")
    def set_fp32_grad_for_param(self, value, param):
        # Why: it writes a gradient partition (through _get_fp32_grad_state_partition, gated too).
        return super().set_fp32_grad_for_param(value, param)

    @reads_gradients("writing a gradient (safe_set_local_grad)")
    def set_local_grad_for_param(self, value, param):
        # Why: it writes a gradient partition (through _get_fp32_grad_state_partition, gated too).
        return super().set_local_grad_for_param(value, param)

    @reads_gradients("updating gradients (safe_update_full_grad_vectorized)")
    def update_fp32_grad_for_param_vectorized(self, update_func, param_list):
        # Why: as _get_fp32_grad_state_partition, for the vectorised update (it reads the partitions directly).
        with gradients_kept_on_device(self):
            return super().update_fp32_grad_for_param_vectorized(update_func, param_list)

    def independent_gradient_partition_epilogue(self):
        # Why: see gradients_kept_on_device (stock lists the gradients it reads in averaged_gradients here).
        with gradients_kept_on_device(self):
            super().independent_gradient_partition_epilogue()

    def _prepare_sub_group(self, sub_group_id, timer_names):
        # Why: stock's step prepares each sub-group here; with offload_optimizer ODC brings its gradient to the host
        # (into its fp32 master's .grad, where stock's CPU step reads it).
        if self.host_step is not None:
            self.host_step.ready(sub_group_id)
        super()._prepare_sub_group(sub_group_id, timer_names)

    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        # Why: stock copies each sub-group's new fp32 parameters into its shards here, synchronously; with
        # offload_optimizer ODC starts that copy and finishes it before the publish.
        if self.host_step is None or not self.host_step.copy_back(sub_group_id):
            super()._reassign_or_swap_out_partitioned_parameters(sub_group_id)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        # Why: a rank with no microbatch declares its boundary only here; it must take part in early gradient reads.
        super().set_gradient_accumulation_boundary(is_boundary)
        if is_boundary:
            self.odc.declare_boundary()
