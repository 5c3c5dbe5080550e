"""A MoE model's router auxiliary loss under ODC: how much each microbatch's term weighs, in one place.

[Note: per-microbatch means]
Most of a step's loss is a sum over samples or tokens, which ODC splits over any microbatches exactly. A term that is a
mean over one microbatch is not: the MoE router's auxiliary (load-balancing) loss multiplies, per expert, the share of
the microbatch's tokens routed to it by its mean router probability over those tokens. Stock adds it once per
microbatch, each of its ``W * gas`` microbatches of ``B`` samples weighted alike (TRL: ``coef * aux / gas``, before
ZeRO's average over the ``W`` ranks). Under ODC a microbatch of ``n`` of the step's ``G`` samples stands for ``n / B``
stock microbatches, so it gets their weight: ``coef * aux * W * n / G`` (:attr:`Microbatch.sample_share
<ds_odc.integrations._runner.Microbatch.sample_share>` is ``n / G``; a slice of a sample split over ``g`` ranks counts
``1 / g``). Where ODC's microbatches are stock's (one sample per microbatch on both sides, or the same groups) this is
stock's loss; where LB-Mini groups other samples together, each microbatch's term is still the model's own definition
over that microbatch, and only the grouping differs (the term is not additive over samples, so no regrouping
reproduces stock's). The logged ``aux_loss`` is the same weighted mean, per stock microbatch: each sample contributes
the term of the microbatch that trained it.

Who adds the term, and so which coefficient is weighted (each exactly once per microbatch):

* the Hugging Face ``Trainer`` (``OdcTrainer``): the model's forward adds ``router_aux_loss_coef * aux`` to its loss;
  the model's coefficient is weighted (:func:`weighted_router_loss`);
* TRL's ``SFTTrainer``: its loss adds ``trainer.router_aux_loss_coef * aux / gas``; TRL's coefficient is weighted
  (:func:`weighted_router_loss`; the model's is left alone: TRL's fused forward does not use the model's loss);
* TRL's ``GRPOTrainer``: ODC runs TRL's loss once per group of samples that shared a stock microbatch, with the
  router term off, and adds the microbatch's term once (:func:`router_term`);
* TRL's ``DPOTrainer``: refused with ODC (``OdcDPOTrainer`` asks for ``router_aux_loss_coef=0``).
"""

from __future__ import annotations

import contextlib

import torch

from ds_odc.integrations._hf_privates import router_coef, scaled_router_coef
from ds_odc.integrations._runner import Microbatch
from ds_odc.integrations._setup import underlying_model

__all__: list[str] = []


def router_weight(mb: Microbatch, args, *, per_accumulation_step: bool = True) -> float:
    """How many times the term stock adds for one microbatch this microbatch's term weighs: the ``n / B`` stock
    microbatches it stands for, divided by the accumulation steps where stock divides each microbatch's term by them
    (``per_accumulation_step``: TRL's trainers, and the Trainer when the model takes no ``num_items_in_batch``), which
    is ``W * n / G``. ``args``: the trainer's ``TrainingArguments``."""
    if per_accumulation_step:
        return args.world_size * mb.sample_share
    return mb.sample_share * mb.step_samples / args.per_device_train_batch_size


@contextlib.contextmanager
def weighted_router_loss(trainer, mb: Microbatch, loss_scale: float | None = None):
    """Inside the block, the router term that ``trainer``'s stock loss adds for ``mb`` weighs :func:`router_weight`:
    TRL's coefficient for a TRL trainer, else the model's (a MoE causal LM that adds its router loss to its own:
    ``output_router_logits`` in its config). ``loss_scale``: the factor the caller multiplies the whole loss by
    afterwards (the Trainer's loss of a model that takes no ``num_items_in_batch``, reweighted to its share of the
    step's token mean), ``None`` when it does not."""
    if router_coef(trainer) is not None:  # TRL's loss adds coef * aux / gas (gas = 1 under ODC)
        owner, factor = trainer, (router_weight(mb, trainer.args) if mb.step_samples else 1.0)
    else:
        owner = underlying_model(trainer.model)
        if router_coef(owner) is None or not getattr(getattr(owner, "config", None), "output_router_logits", False):
            yield
            return
        if not mb.step_samples:
            factor = 1.0
        elif loss_scale is not None:  # the Trainer divides by gas: the term weighs W * n / G once rescaled
            factor = router_weight(mb, trainer.args) / loss_scale if loss_scale else 0.0
        else:  # the Trainer leaves each microbatch's term whole (num_items_in_batch normalises the rest)
            factor = router_weight(mb, trainer.args, per_accumulation_step=False)
    with scaled_router_coef(owner, factor):
        yield


def router_term(trainer, mb: Microbatch, router_loss: torch.Tensor) -> torch.Tensor:
    """The router term of one microbatch whose loss ODC assembles itself (GRPO: from groups of samples, the router
    term left out of each): TRL's coefficient times the microbatch's router loss, weighted once."""
    return router_coef(trainer) * router_loss * router_weight(mb, trainer.args)
