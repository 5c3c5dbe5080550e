"""A Qwen3-MoE-shaped model with the router auxiliary loss on, in OdcTrainer, OdcSFTTrainer and OdcGRPOTrainer, against
the stock trainer + stock ZeRO-3 (see moe_worker.py).

Where every rank runs stock's microbatches (one sample per microbatch on both sides; LB-Mini with uneven counts or
``local-sort`` with equal ones) ODC equals stock within the bound of ``tests/_support/tolerance.py``, with experts that receive no
token in a microbatch. Where LB-Mini groups other samples than stock, the router loss (a per-microbatch mean) differs
by definition: the distance is measured and compared with stock's own distance between two microbatch sizes."""

from __future__ import annotations

import os

import pytest

from _support.launch import launch
from _support.tolerance import assert_within, compare, compare_logs

pytest.importorskip("trl")

WORKER = os.path.join(os.path.dirname(__file__), "moe_worker.py")
NOT_COMPARED = ("epoch", "step", "learning_rate")
GRPO_SCALES = {"loss": 1.0, "kl": 1.0}  # sums of order-1 terms that nearly cancel: their rounding is their terms'


@pytest.fixture(scope="module")
def two_ranks():
    return launch(WORKER, 2, ["trainer,sft,grpo"], timeout=600).check().result


@pytest.fixture(scope="module")
def three_ranks():
    return launch(WORKER, 3, ["trainer"], timeout=300).check().result


def check_equal_to_stock(case: dict, run: str, scales: dict | None = None) -> None:
    logs = case["logs"]
    assert len(logs[run]) == len(logs["stock"]) == 4
    keys = sorted({k for name in (run, "stock") for e in logs[name] for k in e} - set(NOT_COMPARED))
    assert_within(compare(f"{run} parameters", case["params"][run], case["params"]["fp64"]),
                  *compare_logs(run, logs[run], logs["stock"], logs["fp64"], keys, scales=scales))


def uneven(counts: list[list]) -> bool:
    return any(len(set(step)) > 1 for step in counts)


@pytest.mark.parametrize("ranks", ["two_ranks", "three_ranks"])
def test_trainer_equals_stock(ranks, request):
    case = request.getfixturevalue(ranks)["trainer"]
    assert case["own_loss"]  # the chunked loss would leave the router loss out: the model's own loss is kept
    assert case["stock_moved"] > 1e-2 and uneven(case["microbatches"]), case["microbatches"]
    check_equal_to_stock(case, "odc")


@pytest.mark.parametrize("run", ["odc", "local_sort", "per_module"])
def test_sft_equals_stock(two_ranks, run):
    case = two_ranks["sft"]
    assert case["stock_moved"] > 1e-2 and case["idle"][run]["idle"] > 0, case["idle"]  # some expert got no token
    assert uneven(case["microbatches"]["odc"]) and not uneven(case["microbatches"]["local_sort"])
    assert "aux_loss" in case["logs"][run][0]
    check_equal_to_stock(case, run)


@pytest.mark.parametrize("run", ["packed", "padded"])
def test_grpo_equals_stock(two_ranks, run):
    case = two_ranks["grpo"]
    assert case["optimizers"][run] == "OdcOptimizer" and case["stock_moved"] > 1e-2
    assert case["idle"][run]["idle"] > 0, case["idle"]
    assert uneven(case["microbatches"]["padded"]), case["microbatches"]
    assert "aux_loss" in case["logs"][run][0] and max(e["kl"] for e in case["logs"]["stock"]) > 1e-4
    check_equal_to_stock(case, run, scales=GRPO_SCALES)


@pytest.mark.parametrize("trainer, run", [("sft", "packed"), ("grpo", "packed")])
def test_other_grouping_moves_as_far_as_stock_itself_does(two_ranks, trainer, run):
    # LB-Mini packs other samples together than stock (here with two or four samples per microbatch) does: the router
    # loss differs, by far more than rounding, but no more than stock's own result moves when it trains one sample per
    # microbatch instead (the yardstick: the same data, weights and steps).
    case = two_ranks[trainer]
    grouping = case["grouping"]
    measured, yardstick = grouping["params"][run], grouping["params"]["stock_one_per_microbatch"]
    assert measured > 100 * compare("", 0.0, case["params"]["fp64"]).bound, grouping["params"]  # stock's rounding
    assert measured <= 2 * yardstick, grouping["params"]


# -- the router term weighted exactly once, on every path (one process, no training) -------------------------------------
def _moe_model():
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from moe_worker import tiny_qwen3_moe
    return tiny_qwen3_moe(64)


def _row(n: int = 12):
    import torch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (1, n), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _microbatch(inputs, **kw):
    from ds_odc.integrations._runner import Microbatch
    from ds_odc.integrations._stock_metrics import SlotMetrics
    # One sample of a step of 4 (on W = 1 rank, B = 2 per device): it stands for n / B = 1/2 stock microbatch, and
    # for W * n / G = 1/4 of one where stock divides each microbatch's term by the accumulation steps.
    return Microbatch(inputs, (0,), (0,), SlotMetrics(), step_samples=4, **kw)


def _coef_during_forward(model, run):
    """``run()``'s result and the model's router coefficient in each of its forwards."""
    seen = []
    handle = model.register_forward_pre_hook(lambda module, args: seen.append(module.router_aux_loss_coef))
    try:
        return run(), seen
    finally:
        handle.remove()


def test_the_router_loss_is_weighted_exactly_once_on_every_path(tmp_path):
    """OdcTrainer weighs the model's coefficient (by n / B with num_items_in_batch, as the Trainer adds each
    microbatch's term whole; by W * n / G without, as it divides by the accumulation steps); OdcSFTTrainer weighs
    TRL's coefficient by W * n / G and leaves the model's alone; GRPO adds its term once; DPO refuses the router loss
    with ODC. Each is compared with the stock loss computed with the coefficient weighted by hand, and shown to
    differ from the term weighted twice or not at all."""
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from ds_odc.integrations._router_loss import router_term, router_weight
    from ds_odc.integrations.transformers import OdcTrainer
    from ds_odc.integrations.trl_sft import OdcSFTTrainer
    from ds_odc.recipes.toy_text import char_tokenizer

    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                  gradient_accumulation_steps=1)
    model = _moe_model()
    coef = model.router_aux_loss_coef
    inputs = _row()
    tokens = torch.tensor(int(inputs["labels"].shape[1] - 1))

    def stock(trainer, stock_loss, owner, factor, **kw):
        owner.router_aux_loss_coef = coef * factor
        try:
            with torch.no_grad():
                return stock_loss(trainer, trainer.model, dict(inputs), **kw)
        finally:
            owner.router_aux_loss_coef = coef

    # The Hugging Face Trainer: the model's forward adds coef * aux
    trainer = OdcTrainer(model, TrainingArguments(**common), train_dataset=[{"input_ids": [1, 2]}] * 4)
    for mb, factor, kw in [(_microbatch(inputs, num_items_in_batch=tokens), 0.5, {"num_items_in_batch": tokens}),
                           (_microbatch(inputs, label_tokens=11, step_label_tokens=11), 0.25, {})]:
        assert factor == router_weight(mb, trainer.args, per_accumulation_step="num_items_in_batch" not in kw)
        with torch.no_grad():
            loss, coefs = _coef_during_forward(model, lambda: trainer.odc_loss(model, mb))
        assert coefs == [coef * factor] and model.router_aux_loss_coef == coef
        assert torch.equal(loss, stock(trainer, Trainer.compute_loss, model, factor, **kw))
        for wrong in (factor * factor, 1.0, 0.0):  # weighted twice, not at all, no term: the comparison sees it
            assert not torch.allclose(loss, stock(trainer, Trainer.compute_loss, model, wrong, **kw), rtol=1e-5)

    # TRL's SFTTrainer: its loss adds trainer.router_aux_loss_coef * aux / gas; the model's coefficient stays
    model = _moe_model()
    sft = OdcSFTTrainer(model, SFTConfig(**common), processing_class=char_tokenizer(),
                        train_dataset=Dataset.from_dict({"prompt": ["Q: a"] * 4, "completion": [" b"] * 4}))
    sft.current_gradient_accumulation_steps = 1  # as the training loop sets it (1 under ODC)
    trl_coef = sft.router_aux_loss_coef
    assert trl_coef == coef and sft.aux_loss_enabled
    mb = _microbatch(inputs, num_items_in_batch=tokens)
    with torch.no_grad():
        loss, coefs = _coef_during_forward(model, lambda: sft.odc_loss(model, mb))
    assert coefs == [coef] and sft.router_aux_loss_coef == trl_coef  # the model's left alone, TRL's restored
    assert torch.equal(loss, stock(sft, SFTTrainer.compute_loss, sft, 0.25, num_items_in_batch=tokens))
    for wrong in (0.25 * 0.25, 1.0, 0.0):
        assert not torch.allclose(loss, stock(sft, SFTTrainer.compute_loss, sft, wrong, num_items_in_batch=tokens),
                                  rtol=1e-5)

    # GRPO assembles its loss from groups with TRL's router term off and adds the microbatch's once
    aux = torch.tensor(0.7)
    assert torch.equal(router_term(sft, mb, aux), trl_coef * aux * 0.25)
