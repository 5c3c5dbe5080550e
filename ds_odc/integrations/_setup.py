"""What a ds_odc trainer settles once, when it is built: whether the DeepSpeed config turns ODC on, its balancer
options (one record, from the keywords or given whole), the split policy of a planner that splits samples, the
arguments of one loader item per optimizer step, and the model whose forward computes the loss."""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import replace
from typing import Any

from ds_odc.balancer.options import BalancerOptions
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.config import odc_config_from_ds_config
from ds_odc.zero.engine import odc_requested
from ds_odc.zero.planned import balancer_unread_explained

__all__: list[str] = []


def deepspeed_config_of(args) -> dict | None:
    """The DeepSpeed config dict of ``TrainingArguments``: passed as ``deepspeed=...``, or the
    ``deepspeed_config_file`` of an ``accelerate launch`` config (Accelerate's DeepSpeed plugin holds it)."""
    config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if not isinstance(config, dict):
        config = getattr(getattr(args, "deepspeed_plugin", None), "deepspeed_config", None)
    return config if isinstance(config, dict) else None


def odc_enabled(args) -> bool:
    """Whether ``TrainingArguments`` carry a DeepSpeed config with ``zero_optimization.odc`` on (before any engine
    exists; once it does, :func:`ds_odc.zero.engine.is_odc` answers)."""
    config = deepspeed_config_of(args)
    return config is not None and odc_requested(config)


def warn_of_unread_balancer_block(args, trainer: str) -> None:
    """A trainer plans with its keywords, never with the ds_config's ``zero_optimization.odc.balancer`` block (which
    ``deepspeed.initialize(training_data=...)`` reads in the stock loop): a warning when ``args`` carry such a block,
    instead of ignoring it without a word."""
    config = None if args is None else deepspeed_config_of(args)
    if config is None or odc_config_from_ds_config(config).balancer is None:
        return
    balancer_unread_explained()
    warnings.warn(f"ds_odc: {trainer} plans with its own keywords and does not read zero_optimization.odc.balancer "
                  "(only the stock loop's deepspeed.initialize(training_data=...) does): pass those settings as "
                  "keywords (balancer_planner, max_tokens_per_microbatch, balancer_cost, oversize, length_column; "
                  "docs/CONFIG.md maps each key onto its keyword) and drop the block", UserWarning, stacklevel=3)


# The trainers' loose balancer keywords and the BalancerOptions field each one sets (the field of the same name as the
# stock loop's ``zero_optimization.odc.balancer`` key but ``split``: docs/CONFIG.md has the whole table).
_KEYWORDS = {"balancer_planner": "planner", "max_tokens_per_microbatch": "max_tokens", "balancer_cost": "cost",
             "oversize": "oversize", "split_policy": "split", "length_column": "length_column"}


def balancer_options(balancer: BalancerOptions | None = None, **keywords) -> BalancerOptions:
    """A trainer's :class:`BalancerOptions`: ``balancer`` as given, or built from the loose keywords (``balancer_planner``,
    ``max_tokens_per_microbatch``, ``balancer_cost``, ``oversize``, ``split_policy``, ``length_column``), which must
    then be left at their defaults. Errors name the keyword as the caller wrote it (``max_tokens_per_microbatch=0``),
    each checked by :class:`BalancerOptions` on its own, so the record's rules are the only ones."""
    defaults = BalancerOptions()
    if balancer is not None:
        if not isinstance(balancer, BalancerOptions):
            raise ValueError(f"ds_odc: balancer must be a ds_odc.balancer.BalancerOptions, got {type(balancer).__name__}")
        given = [k for k, v in keywords.items() if _differs(v, getattr(defaults, _KEYWORDS[k]))]
        if given:
            raise ValueError(f"ds_odc: pass the balancer's options either as balancer=BalancerOptions(...) or as "
                             f"keywords, not both: drop {', '.join(given)} or set it in the BalancerOptions")
        return balancer
    for keyword, value in keywords.items():
        try:
            BalancerOptions(**{_KEYWORDS[keyword]: value})
        except ValueError as err:
            raise ValueError(f"ds_odc: {keyword}={value!r}: {err}") from None
    return BalancerOptions(**{_KEYWORDS[k]: v for k, v in keywords.items()})


def _differs(value: Any, default: Any) -> bool:
    return not (value is default or (type(value) is type(default) and value == default))


def with_split_policy(options: BalancerOptions, model_config) -> BalancerOptions:
    """``options`` with the split policy its planner uses: the given one or, for a planner that splits samples, one
    from the model config's heads with the launcher's ``LOCAL_WORLD_SIZE`` ranks per node; ``None`` otherwise."""
    if not options.spec.splits:
        return replace(options, split=None)
    if options.split is not None:
        return options
    return replace(options, split=SplitPolicy.from_hf_config(
        model_config, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 8))))


def one_pack_per_step(args):
    """``(args, samples per rank)``: a copy of ``TrainingArguments`` with ``gradient_accumulation_steps = 1`` (the
    loader yields one pack per optimizer step, so the Trainer's own loop must run one ``training_step`` per step; the
    caller's args stay as given), and the samples per rank per optimizer step, as the stock Trainer counts them."""
    samples_per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args = copy.copy(args)
    args.gradient_accumulation_steps = 1
    return args, samples_per_rank


def underlying_model(model):
    """The model whose forward computes the loss: a PEFT model's base model (its adapters live inside that model's
    layers), else ``model`` itself."""
    from accelerate.utils import is_peft_model
    return model.get_base_model() if is_peft_model(model) else model
