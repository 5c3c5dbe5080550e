"""Every private of transformers, Accelerate and TRL that ds_odc's trainers use, in one place.

The trainers override public ``Trainer`` methods wherever one exists; what follows is what they could not do without.
Each entry says why. Code elsewhere in ds_odc reads or writes these names only through the accessors below (an
override may define the method and call its stock version, ``super().<name>(...)``, inside itself);
``tests/test_layout.py`` checks it. :func:`check_transformers` runs when :mod:`ds_odc.integrations.transformers` is imported and
:func:`check_trl` when a TRL trainer is, so a library that renamed or removed one of them fails at import with a
message naming the versions, never with an ``AttributeError`` in the middle of a run or a hang. DeepSpeed's privates
live in :mod:`ds_odc.zero._deepspeed_privates`.

Tested with transformers 5.17-5.24, accelerate 1.15 and trl 1.16.
"""

from __future__ import annotations

import contextlib
import inspect

__all__: list[str] = []

TRL_SUPPORTED = ">=1.16,<1.17"

# transformers.Trainer
TRANSFORMERS_PRIVATES = {
    "_prepare_inputs": "overridden by OdcTrainer: the one place where a batch's host copy and its device copy are both "
                       "at hand, so the document lengths of packed rows are noted without a device-to-host copy (and "
                       "where an ODC microbatch's inputs move to the device)",
    "_remove_unused_columns": "called by OdcTrainer, which builds its own loader and drops columns as the stock one",
    "_loss_shifts_labels": "read by OdcTrainer to count label tokens exactly as the stock get_batch_samples does",
    "save_model(_internal_call)": "the keyword tells a checkpoint save from a user's call: only checkpoints get the "
                                  "balancer state",
}
# accelerate.Accelerator / GradientState
ACCELERATE_PRIVATES = {
    "GradientState._set_sync_gradients": "the Trainer's loop sets it per microbatch; under ODC one Trainer step runs a "
                                         "whole optimizer step, so the trainers set it around their own microbatches",
}
# Written, not only read: accelerate.PartialState.backend (see match_accelerate_backend); a MoE causal LM's
# router_aux_loss_coef (public, read by its forward; scaled per microbatch: scaled_router_coef, weighted by
# ds_odc.integrations._router_loss).
# trl.GRPOTrainer
TRL_GRPO_PRIVATES = {
    "_generate_single_turn": "overridden: generation runs inside lockstep_free instead of TRL's full-model gather",
    "_generate_and_score_completions": "called: TRL's generation, rewards, advantages and old/reference log-probs of "
                                       "one generation batch, before the batch is re-planned across ranks",
    "_get_per_token_logps_and_entropies": "overridden: TRL's loss then reads the log-probs of the microbatch's one "
                                          "forward (padded or packed), and packed rows score old/reference log-probs",
    "_compute_loss": "called on each group of samples that shared a stock microbatch: TRL's own loss and metrics (its "
                     "model argument, which it only hands on to _get_per_token_logps_and_entropies, carries the "
                     "group's log-probs from the microbatch's forward)",
    "_metrics": "redirected while ODC trains a step: TRL's metrics are combined over ranks once, at the step",
    "_step": "TRL's microstep counter, which decides when to generate: advanced once per Trainer microstep",
    "_tokenizer": "read: the pad token of the microbatches ODC collates",
    "_is_vlm": "read: vision-language models are refused (their image inputs are not moved between ranks)",
    "aux_loss_enabled": "off while TRL's loss runs on a group of samples: the MoE router loss is the microbatch's, "
                        "added once per microbatch (public, but TRL's loss reads it: listed so a rename fails early)",
    "router_aux_loss_coef": "read: the weight of the MoE router loss that ODC adds per microbatch",
}
# trl.SFTTrainer
# Set by the trainers' __init__: checked on the built trainer (check_trl_instance), not at import.
INSTANCE_ATTRIBUTES = ("_metrics", "_step", "_tokenizer", "_is_vlm", "_total_train_tokens", "aux_loss_enabled",
                       "router_aux_loss_coef", "_precompute_engine")

TRL_SFT_PRIVATES = {
    "_metrics": "redirected while ODC trains a step: TRL's metrics are combined over ranks once, at the step",
    "_total_train_tokens": "the running token count TRL logs as num_tokens, set from all ranks' tokens at the step",
    "router_aux_loss_coef": "scaled while a microbatch's loss is computed: SFTTrainer adds the MoE router loss once "
                            "per microbatch, which ODC weighs by the microbatch's share of the step's samples",
}
# trl.DPOTrainer
TRL_DPO_PRIVATES = {
    "_compute_loss": "called on the pairs of each stock microbatch within an ODC microbatch: TRL's own loss and "
                     "metrics for every loss_type, its model argument (and the trainer's ref_model, swapped around "
                     "the call) serving the per-token log-probs of the microbatch's one forward",
    "_metrics": "redirected while ODC trains a step: TRL's metrics are combined over ranks once, at the step",
    "_total_train_tokens": "the running token count TRL logs as num_tokens, set from the minibatch's tokens at the "
                           "step",
    "_precompute_engine": "released once TRL has precomputed the reference log-probs with it: an inference engine "
                          "around the policy itself (precompute_ref_log_probs without a ref_model), whose ZeRO-3 hooks "
                          "stay on the policy's modules and would gather with collectives in every ODC forward",
}


def _missing(owner, names) -> list[str]:
    out = []
    for name in names:
        attr, _, keyword = name.partition("(")
        if not hasattr(owner, attr):
            out.append(name)
        elif keyword and keyword.rstrip(")") not in inspect.signature(getattr(owner, attr)).parameters:
            out.append(name)
    return out


def check_transformers() -> None:
    """Fail at import, with the versions, if transformers or Accelerate lacks a private the trainers use."""
    import accelerate
    import transformers
    from accelerate.state import GradientState
    from transformers import Trainer

    methods = [n for n in TRANSFORMERS_PRIVATES if n != "_loss_shifts_labels"]  # an attribute, read with a default
    missing = [f"Trainer.{n}" for n in _missing(Trainer, methods)]
    missing += [f"accelerate.{n}" for n in ACCELERATE_PRIVATES if not hasattr(GradientState, n.split(".")[1])]
    if missing:
        raise ImportError(f"ds_odc: OdcTrainer needs {', '.join(missing)}, which transformers "
                          f"{transformers.__version__} / accelerate {accelerate.__version__} lack; it is tested with "
                          "transformers 5.17-5.24 and accelerate 1.15")


def check_trl(trainer_cls, privates: dict) -> None:
    """Fail at import, with the version, if TRL's ``trainer_cls`` lacks a method listed in ``privates``."""
    _raise_missing(trainer_cls.__name__, _missing(trainer_cls, [n for n in privates if n not in INSTANCE_ATTRIBUTES]))


def check_trl_instance(trainer, privates: dict) -> None:
    """The same for the instance attributes in ``privates``, on a trainer that TRL's ``__init__`` has built."""
    _raise_missing(type(trainer).__name__, [n for n in privates if n in INSTANCE_ATTRIBUTES
                                            and not hasattr(trainer, n)])


def _raise_missing(owner: str, missing: list[str]) -> None:
    if missing:
        import trl
        raise ImportError(f"ds_odc: {owner} needs {', '.join(missing)}, which trl {trl.__version__} lacks; ds_odc "
                          f"is tested with trl 1.16 (pip install 'trl{TRL_SUPPORTED}')")


# -- accessors: the one way the trainers read or write a name of the registers above ---------------------------------
def prepare_inputs(trainer, inputs):
    """See TRANSFORMERS_PRIVATES: ``trainer``'s move of a batch to the device (``OdcTrainer``'s override included)."""
    return trainer._prepare_inputs(inputs)


def set_sync_gradients(accelerator, value: bool) -> None:
    """See ACCELERATE_PRIVATES: sync off, Accelerate marks no boundary and does not step (ODC pushes the gradients);
    sync on, the next backward or explicit step is the boundary."""
    accelerator.gradient_state._set_sync_gradients(value)


def release_precompute_engine(trainer) -> None:
    """See TRL_DPO_PRIVATES: take the ZeRO-3 hooks of TRL's precompute engine off the policy's modules
    (:func:`~ds_odc.zero.engine.destroy_engine`), once the reference log-probs are precomputed."""
    from ds_odc.zero.engine import destroy_engine
    engine = trainer._precompute_engine
    if engine is not None:
        destroy_engine(engine)
        trainer._precompute_engine = None


def loss_shifts_labels(trainer) -> bool:
    """See TRANSFORMERS_PRIVATES (absent before transformers 5: the causal-LM loss always shifted)."""
    return getattr(trainer, "_loss_shifts_labels", True)


def remove_unused_columns(trainer, dataset):
    """See TRANSFORMERS_PRIVATES: what the stock train loader does to a ``datasets.Dataset``."""
    return trainer._remove_unused_columns(dataset, description="training")


def trl_step_context(trainer):
    """What TRL's SFT and DPO trainers run their ``training_step`` inside (``maybe_activation_offload_context``:
    activation offloading), or a null context. An ODC step trains its microbatches without that ``training_step``, so
    each microbatch runs inside it instead."""
    return getattr(trainer, "maybe_activation_offload_context", None) or contextlib.nullcontext()


def trl_train_metrics(trainer) -> dict:
    """See TRL_*_PRIVATES (``_metrics``): the training metrics TRL logs next, by name (lists of values)."""
    return trainer._metrics["train"]


@contextlib.contextmanager
def redirected_trl_metrics(trainer, sink: dict, *, keep_token_count: bool = False):
    """See TRL_*_PRIVATES (``_metrics``, ``_total_train_tokens``): inside the block TRL's training metrics go to
    ``sink``; afterwards they go where they went before, and with ``keep_token_count`` TRL's running token count is
    what it was (ODC sets it once per step, from every rank's tokens)."""
    logged = trainer._metrics["train"]
    tokens = trainer._total_train_tokens if keep_token_count else None
    trainer._metrics["train"] = sink
    try:
        yield sink
    finally:
        trainer._metrics["train"] = logged
        if keep_token_count:
            trainer._total_train_tokens = tokens


def add_trl_train_tokens(trainer, tokens: int) -> int:
    """See TRL_SFT_PRIVATES / TRL_DPO_PRIVATES (``_total_train_tokens``): add ``tokens`` to TRL's running count (logged
    as ``num_tokens``); returns the new count."""
    trainer._total_train_tokens += tokens
    return trainer._total_train_tokens


def trl_loss(trainer, *args):
    """See TRL_GRPO_PRIVATES / TRL_DPO_PRIVATES (``_compute_loss``): TRL's own loss of one batch."""
    return trainer._compute_loss(*args)


def grpo_per_token_logps(trainer, *args, **kwargs):
    """See TRL_GRPO_PRIVATES (``_get_per_token_logps_and_entropies``): TRL's own padded scoring, past the override."""
    from trl import GRPOTrainer
    return GRPOTrainer._get_per_token_logps_and_entropies(trainer, *args, **kwargs)


def generate_and_score(trainer, inputs):
    """See TRL_GRPO_PRIVATES (``_generate_and_score_completions``): one generation batch, scored, as TRL makes it."""
    return trainer._generate_and_score_completions(inputs)


def trl_microstep(trainer) -> int:
    """See TRL_GRPO_PRIVATES (``_step``): TRL's microstep counter."""
    return trainer._step


def advance_trl_microstep(trainer) -> None:
    """See TRL_GRPO_PRIVATES (``_step``): one Trainer microstep done."""
    trainer._step += 1


def trl_pad_token_id(trainer) -> int:
    """See TRL_GRPO_PRIVATES (``_tokenizer``): the pad token of the microbatches ODC collates."""
    return trainer._tokenizer.pad_token_id


def is_vision_language(trainer) -> bool:
    """See TRL_GRPO_PRIVATES (``_is_vlm``)."""
    return bool(trainer._is_vlm)


def router_loss_enabled(trainer) -> bool:
    """See TRL_GRPO_PRIVATES (``aux_loss_enabled``): whether TRL's loss adds a MoE router term."""
    return bool(trainer.aux_loss_enabled)


@contextlib.contextmanager
def router_loss_left_out(trainer):
    """See TRL_GRPO_PRIVATES (``aux_loss_enabled``): TRL's loss adds no router term inside the block."""
    enabled, trainer.aux_loss_enabled = trainer.aux_loss_enabled, False
    try:
        yield
    finally:
        trainer.aux_loss_enabled = enabled


def router_coef(owner) -> float | None:
    """``router_aux_loss_coef`` of a TRL trainer (TRL_*_PRIVATES) or of a MoE causal LM (read by its forward); ``None``
    where ``owner`` has none."""
    return getattr(owner, "router_aux_loss_coef", None)


@contextlib.contextmanager
def scaled_router_coef(owner, factor: float):
    """``owner``'s ``router_aux_loss_coef`` (:func:`router_coef`) is ``factor`` times what it was inside the block."""
    coef = owner.router_aux_loss_coef
    owner.router_aux_loss_coef = coef * factor
    try:
        yield
    finally:
        owner.router_aux_loss_coef = coef


@contextlib.contextmanager
def rank_local_collectives(accelerator, on_reduce=None):
    """Accelerate's ``reduce``, ``gather`` and ``gather_for_metrics`` return this rank's tensor unchanged inside the
    block (instance attributes shadow the methods). Why: TRL's losses combine their metrics across ranks on every
    microbatch, which deadlocks once ranks run different microbatch counts; the trainers combine them at the step.
    ``on_reduce(tensor)`` sees every tensor TRL would have reduced (the sums behind its token means)."""
    def reduce(tensor, *args, **kwargs):
        if on_reduce is not None:
            on_reduce(tensor)
        return tensor

    def local(tensor, *args, **kwargs):
        return tensor

    accelerator.reduce, accelerator.gather, accelerator.gather_for_metrics = reduce, local, local
    try:
        yield
    finally:
        del accelerator.reduce, accelerator.gather, accelerator.gather_for_metrics


def match_accelerate_backend(args) -> None:
    """Make Accelerate's state name the backend torch.distributed really runs, when that is gloo. Why: with a
    ``deepspeed`` config, ``TrainingArguments`` does not hand ``ddp_backend`` to Accelerate, which then assumes "nccl"
    on CUDA and gathers into one flat tensor, a call gloo rejects for 2-D tensors (TRL's reward gather). That is the
    case when several ranks share one GPU. ``args``: the trainer's ``TrainingArguments`` (after the trainer is built)."""
    import torch.distributed as dist
    state = getattr(args, "distributed_state", None)
    if state is None or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "gloo" and getattr(state, "backend", None) != "gloo":
        state.backend = "gloo"
