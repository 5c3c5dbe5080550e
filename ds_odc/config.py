"""The ``zero_optimization.odc`` config block.

Users write either ``"odc": true`` or a sub-dict::

    "zero_optimization": {"stage": 3, "odc": {"enabled": true, "transport": "auto", "timeout_s": 300}}

The model follows DeepSpeed's own config models (pydantic, ``extra="forbid"``), so a misspelt key inside ``odc`` is
an error at ``deepspeed.initialize`` (and at ``deepspeed.zero.Init``), like any other ZeRO key. Errors in the
``zero_optimization`` block name the key as the ds_config spells it (``zero_optimization.odc.enabld``), and an
unknown key comes with the closest valid one.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any, Literal, Optional, Union

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from pydantic import BaseModel, Field, PositiveInt, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ds_odc.balancer.plan import OVERSIZE_POLICIES, check_max_tokens

__all__ = ["OdcConfig", "odc_config_from_ds_config"]


class BalancerConfig(DeepSpeedConfigModel):
    """LB-Mini in the stock DeepSpeed loop: ``deepspeed.initialize(training_data=...)`` returns a loader that yields
    this rank's microbatches of each planned minibatch, and the engine follows the plan (the accumulation boundary at
    each rank's last microbatch, each microbatch's loss weighted in ``engine.backward`` so the update is the gradient
    of the minibatch's global mean loss, the step's identity checked where the ranks meet)."""

    planner: Literal["lb-mini", "lb-micro", "local-sort"] = "lb-mini"
    """``lb-mini``: any number of microbatches per rank, balanced per minibatch (ODC only). ``lb-micro``: balanced,
    the same count on every rank; ``local-sort``: each rank sorts its own samples (both run on stock ZeRO-3 too)."""

    minibatch_size: Optional[PositiveInt] = None
    """Samples per rank in one minibatch (one optimizer step trains this many times the number of ranks). Default:
    ``train_batch_size`` divided by the number of ranks (``train_micro_batch_size_per_gpu`` x
    ``gradient_accumulation_steps``)."""

    max_tokens: Optional[int] = None
    """Token budget of one microbatch (samples are packed up to it). ``None``: one sample per microbatch."""

    cost: Literal["auto", "tokens", "quadratic"] = "auto"
    """What the planner balances. ``auto``: a cost fitted from the engine's own measured step times (one small
    all-gather per step), starting from the model's shape. ``tokens``: tokens. ``quadratic``: the model's training
    FLOPs per sample (needs a Hugging Face model config)."""

    oversize: Literal[OVERSIZE_POLICIES] = "error"
    """A sample longer than ``max_tokens``: ``error`` (refused when the loader is built, naming it), ``truncate``
    (its first ``max_tokens`` tokens are trained) or ``skip`` (left out of every epoch, counted in a log line)."""

    loss: Literal["token_mean", "sample_mean", "sum"] = "token_mean"
    """What the loss handed to ``engine.backward`` is for one microbatch: ``token_mean``, the mean over its label
    tokens (a Hugging Face causal LM's ``outputs.loss``); ``sample_mean``, the mean over its samples; ``sum``, the
    sum over its label tokens. Each microbatch's loss is weighted so that the step trains the mean over all label
    tokens (``token_mean``, ``sum``) or all samples (``sample_mean``) of the minibatch, on whichever rank they are."""

    length_column: str = "input_ids"
    """The field of each sample with its tokens (whose length is read) or with its length."""

    seed: int = 0
    """Seed of each epoch's shuffle (every rank draws the same minibatches)."""

    shuffle: bool = True
    """Shuffle the samples each epoch; ``false``: minibatches in dataset order."""

    @field_validator("max_tokens")
    @classmethod
    def _budget(cls, value: Optional[int]) -> Optional[int]:
        return check_max_tokens(value)  # the balancer's own rule, as the trainers' keywords and the sampler apply it


class OdcConfig(DeepSpeedConfigModel):
    """On-Demand Communication: one-sided parameter reads and gradient pushes, one meeting per optimizer step."""

    enabled: bool = True
    """Turn ODC on. ``"odc": true`` is shorthand for ``{"enabled": true}``."""

    transport: Literal["auto", "shm", "nvshmem"] = "auto"
    """``shm``: shared memory between the ranks of one host (CPU). ``nvshmem``: NVSHMEM symmetric memory (CUDA).
    ``auto``: ``nvshmem`` when the ranks run on CUDA devices, else ``shm``."""

    timeout_s: float = Field(300.0, gt=0)
    """How long a rank waits at the optimizer-step fence for the others. A rank that has not arrived by then (or
    has died) turns into an error on every other rank that names it, instead of a hang."""

    fetch_unit: Literal["block", "module"] = "block"
    """``block``: DeepSpeed's hooks run once per transformer block, which reads all of its parameters at once (the
    blocks are the model's ``_no_split_modules`` classes, what FSDP wraps by). ``module``: once per submodule, as
    stock ZeRO-3 does, which costs host time per linear layer. Ignored when the config sets DeepSpeed's own
    ``zero_optimization.leaf_module``."""

    force_remote_path: bool = False
    """GPU only: never use NVLink peer pointers, only NVSHMEM get/put/signal (the path a multi-node job takes). For
    testing that path on one host."""

    deterministic: bool = False
    """GPU only: add every rank's gradient pushes into an owner's accumulator in a fixed order (per-source staging
    slots, summed in rank order at the step), so runs are bit-reproducible; costs (W-1) x the accumulator in GPU
    memory. Off: pushes reduce straight into the owner's fp32 accumulator in whatever order they land. The CPU
    transport is always deterministic."""

    shard_size: Optional[Union[PositiveInt, Literal["node"]]] = None
    """How many ranks share one copy of the model state (parameters, gradients, optimizer state). ``None`` (the
    default): every rank of the job, as stock ZeRO-3. ``"node"``: the ranks of one node (``LOCAL_WORLD_SIZE``).
    An integer S that divides the world size W: consecutive ranks ``[g*S, (g+1)*S)`` form shard group ``g``, each
    holding one shard of the model; the W/S groups hold replicas. Reads and pushes stay inside a shard group, and
    once per optimizer step each rank's accumulated gradient shard is summed with the other groups' copies of it (one
    all-reduce over the W/S ranks holding that shard). Each GPU then holds 1/S of the model state instead of 1/W."""

    lockstep: bool = False
    """A baseline for measuring, not for production: ODC with a meeting of every rank before each block's forward
    fetch and after its backward, as ZeRO-3's per-layer all-gathers and reduce-scatters make every rank wait for
    every other; the same transport, kernels and buffers as ODC otherwise, so the difference between the two is what
    meeting only at the optimizer step buys. On CUDA (``nvshmem``) a meeting is a small kernel on the compute stream
    (the GPU waits, as for an NCCL collective; the host does not); on CPU (``shm``) and on the
    ``force_remote_path`` it is a host meeting. As under stock ZeRO-3, every rank must run the same number of
    microbatches in each step: a rank that runs fewer (or stops) is named in an error within ``timeout_s``, never a
    hang. Not with ``shard_size``."""

    bootstrap: Literal["auto", "uid", "mpi", "mpi-native"] = "auto"
    """GPU only: how NVSHMEM starts. ``uid``: its unique id is sent over torch.distributed; ``mpi``: over mpi4py;
    ``mpi-native``: NVSHMEM's own MPI bootstrap plugin (must match the MPI library in use); ``auto``: ``mpi`` when
    launched by mpirun, else ``uid``."""

    balancer: Optional[BalancerConfig] = None
    """Balance the stock DeepSpeed loop: with it, ``deepspeed.initialize(training_data=dataset, collate_fn=...)``
    returns a loader of this rank's planned microbatches and the plain ``loss = engine(batch);
    engine.backward(loss); engine.step()`` trains LB-Mini (see :class:`BalancerConfig`). ``None``: the loader and the
    loop are stock's (ODC then needs the same number of microbatches on every rank, as stock ZeRO-3 does)."""

    @model_validator(mode="after")
    def _balancer_fits(self):
        if self.balancer is None:
            return self
        planner = self.balancer.planner
        if planner == "lb-mini" and not self.enabled:
            raise ValueError("zero_optimization.odc.balancer.planner 'lb-mini' gives ranks different numbers of "
                             "microbatches, which only ODC trains: turn ODC on (zero_optimization.odc.enabled), or "
                             "choose the planner 'lb-micro' for stock ZeRO-3")
        if planner == "lb-mini" and self.lockstep:
            raise ValueError("zero_optimization.odc.lockstep needs the same number of microbatches on every rank, "
                             "which zero_optimization.odc.balancer.planner 'lb-mini' does not give: choose 'lb-micro' "
                             "or 'local-sort' for the lock-step baseline")
        return self

    @model_validator(mode="after")
    def _lockstep_alone(self):
        if self.lockstep and self.shard_size is not None:
            raise ValueError("zero_optimization.odc.lockstep meets every rank of the job at every block, "
                             "which hybrid sharding does not do: leave zero_optimization.odc.shard_size out, or set "
                             "lockstep to false")
        return self


class OdcZeroConfig(DeepSpeedZeroConfig):
    """DeepSpeed's ZeRO config plus the ``odc`` key. Installed in place of ``DeepSpeedZeroConfig`` by ``ds_odc.patch()``."""

    odc: OdcConfig = Field(default_factory=lambda: OdcConfig(enabled=False))

    def __init__(self, strict=False, **data):
        try:
            super().__init__(strict=strict, **data)
        except ValidationError as err:
            raise _as_the_user_wrote_it(err, type(self)) from None

    @model_validator(mode="after")
    def _odc_defaults(self):
        # DeepSpeed's memory_efficient_linear swaps F.linear for a Python autograd function (host time on every linear
        # backward) whose point is re-gathering weights the hooks released; ODC's block fetch keeps them gathered.
        if self.odc.enabled and "memory_efficient_linear" not in self.model_fields_set:
            self.memory_efficient_linear = False
        return self

    @field_validator("odc", mode="before")
    @classmethod
    def _bool_shorthand(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return {"enabled": value}
        if value is None:
            return {"enabled": False}
        return value


def _model_at(model: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The config model that validates the dict at ``path`` (keys as written, aliases included) inside ``model``."""
    for key in path:
        field = next((f for name, f in model.model_fields.items() if key in (name, f.alias)), None)
        if field is None:
            return None
        found = [t for t in (field.annotation, *typing.get_args(field.annotation))
                 if isinstance(t, type) and issubclass(t, BaseModel)]
        if not found:
            return None
        model = found[0]
    return model


def _keys(model: type[BaseModel] | None) -> list[str]:
    return sorted({k for name, f in model.model_fields.items() for k in (name, f.alias) if k}) if model else []


def _unknown_key(model: type[BaseModel] | None, key: str) -> PydanticCustomError:
    valid = _keys(model)
    closest = difflib.get_close_matches(key, valid, n=1)
    message = f"unknown key {key!r}" + (f": did you mean {closest[0]!r}?" if closest else "")
    if 0 < len(valid) <= 12:
        message += f" (valid keys here: {', '.join(valid)})"
    return PydanticCustomError("unknown_key", message)


def _not_an_object(path: tuple, model: type[BaseModel] | None) -> PydanticCustomError:
    """pydantic's "valid dictionary or instance of <internal class>", said as what the ds_config may hold there."""
    shorthand = "true (on, with the defaults), false, or " if path == ("odc",) else ""  # OdcZeroConfig._bool_shorthand
    valid = _keys(model)
    keys = f" with the keys {', '.join(valid)}" if 0 < len(valid) <= 12 else ""
    return PydanticCustomError("not_an_object", f"Input should be {shorthand}an object{keys}")


def _as_the_user_wrote_it(err: ValidationError, model: type[BaseModel]) -> ValidationError:
    """``err`` with every location written from the top of the ds_config (``zero_optimization.odc.enabld``, not
    pydantic's title naming this internal class), unknown keys given their closest valid spelling, and a value that
    should have been an object told which keys (and, for ``odc``, which shorthands) it takes."""
    details = []
    for e in err.errors():
        loc = tuple(e["loc"])
        kind = e["type"]
        if kind == "extra_forbidden":
            kind = _unknown_key(_model_at(model, loc[:-1]), str(loc[-1]))
        elif kind == "model_type":
            kind = _not_an_object(loc, _model_at(model, loc))
        details.append({"type": kind, "loc": ("zero_optimization", *loc), "input": e["input"],
                        **({"ctx": e["ctx"]} if "ctx" in e and isinstance(kind, str) else {})})
    return ValidationError.from_exception_data("ds_config", details)


def odc_config_from_ds_config(ds_config: dict) -> OdcConfig:
    """The ``odc`` block of a raw ds_config dict (what DeepSpeed hands its stage-3 optimizer)."""
    return OdcZeroConfig(**ds_config.get("zero_optimization", {})).odc
