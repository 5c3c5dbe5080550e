"""Single-process tests of the pack loader pieces (no distributed, no model)."""

from __future__ import annotations

import pytest
import torch
from accelerate.data_loader import skip_first_batches

from ds_odc.training.collate import PackedCollator
from ds_odc.balancer.sampler import BalancedBatchSampler
from ds_odc.integrations._metrics import BalanceMeter
from ds_odc.integrations._packs import Pack, PackBatchSampler, PackCollator, PackDataset, PackLoader
from ds_odc.training.loss import count_loss_tokens
from ds_odc.training.metrics import bubble_rate, record_from_rows

LENGTHS = [5, 17, 9, 30, 4, 12, 22, 7, 15, 11, 26, 6]


def loader(rank: int = 0, world: int = 2):
    data = [{"input_ids": list(range(1, n + 1))} for n in LENGTHS]
    sampler = BalancedBatchSampler(LENGTHS, world_size=world, rank=rank, minibatch_size=3, max_tokens=32, seed=3)
    return PackLoader(PackDataset(data), batch_sampler=PackBatchSampler(sampler),
                      collate_fn=PackCollator(PackedCollator()))


def test_packs_cover_each_global_minibatch_once():
    for epoch in (0, 1):
        packs = []
        for rank in (0, 1):
            dl = loader(rank)
            dl.set_epoch(epoch)
            packs.append(list(dl))
        assert len(packs[0]) == len(packs[1]) == 2  # same number of optimizer steps on every rank
        order = loader().batch_sampler.sampler.epoch_order(epoch)
        for step in range(2):
            ids = sorted(i for r in (0, 1) for mb in packs[r][step].sample_ids for i in mb)
            assert ids == sorted(order[step * 6:(step + 1) * 6].tolist())
            tokens = sum(count_loss_tokens(mb) for r in (0, 1) for mb in packs[r][step].microbatches)
            assert tokens == packs[0][step].num_tokens - packs[0][step].num_samples  # labels = shifted inputs
            assert all(mb["input_ids"].shape[1] <= 32 for mb in packs[0][step].microbatches)


def test_resume_skips_without_replanning_and_rejects_a_mismatch():
    reference = list(loader())
    dl = loader()
    dl.batch_sampler.resume({**dl.batch_sampler.state_at(0, 1)})
    skipped = skip_first_batches(dl, 1)
    skipped.batch_sampler.batch_sampler.set_epoch(0)  # what the Trainer does after skipping
    rest = list(skipped)
    assert [p.sample_ids for p in rest] == [p.sample_ids for p in reference[1:]]
    unskipped = loader()
    unskipped.batch_sampler.resume(unskipped.batch_sampler.state_at(0, 1))
    unskipped.set_epoch(0)
    with pytest.raises(RuntimeError, match="already trained"):
        list(unskipped)
    other = loader(world=2)
    with pytest.raises(ValueError, match="world_size"):
        other.batch_sampler.resume({**other.batch_sampler.state_at(0, 1), "world_size": 4})


def test_pack_answers_token_counting():
    pack = Pack([{"input_ids": torch.ones(1, 5, dtype=torch.long)}, {"input_ids": torch.ones(1, 3, dtype=torch.long)}],
                epoch=0, step=0, num_samples=2, num_tokens=8)
    assert "input_ids" in pack and pack["input_ids"].numel() == 8 and "attention_mask" not in pack
    assert Pack([], 0, 0, 1, 1)["input_ids"].numel() == 0


def test_balance_meter_uses_the_step_records_definition():
    """The trainer's odc/* logs are the same numbers as examples/sft.py's metrics: one definition of busy and
    bubble (ds_odc.training.metrics), time-weighted over the logging window."""
    # step 1: rank 0 busy 1 s, rank 1 busy 0.5 s of a 1 s step; step 2: both busy 3 s of 3 s.
    first = record_from_rows([[0.0, 1.0, 1.0, 3, 100, 4000], [0.0, 0.5, 0.9, 1, 40, 1600]], num_samples=8)
    second = record_from_rows([[0.0, 3.0, 3.0, 2, 90, 4100], [0.0, 3.0, 3.0, 2, 95, 4500]], num_samples=8)
    assert first.bubble_rate == pytest.approx(0.25)
    meter = BalanceMeter(2)
    meter.data = {"odc/truncated_samples": 2.0}
    meter.add(first)
    meter.add(second)
    first.cost = {"a": 1.0, "b": 2.0, "c": 3.0, "predicted_step_s": None, "measured_step_s": 1.0, "fitted": True}
    second.cost = {"a": 1.5, "b": 2.5, "c": 3.5, "predicted_step_s": 2.8, "measured_step_s": 3.0, "fitted": True}
    out = meter.summary()
    assert out["odc/bubble"] == pytest.approx(bubble_rate([first, second])) == pytest.approx(1 - 7.5 / 8)
    assert out["odc/samples_per_second"] == pytest.approx(16 / 4)
    assert out["odc/microbatches_rank0"] == 2.5 and out["odc/microbatches_rank1"] == 1.5
    assert out["odc/cost_c"] == 3.5 and out["odc/cost_predicted_busy_seconds"] == 2.8
    assert out["odc/truncated_samples"] == 2.0
    meter.reset()
    assert meter.summary() == {}


def test_balance_meter_logs_no_cost_before_a_fit_exists():
    """While the automatic cost still plans with its prior (FLOPs, not seconds) no odc/cost_* is logged."""
    from ds_odc.balancer.autocost import AutoCost
    from ds_odc.balancer.cost import QuadraticCost
    fit = AutoCost(QuadraticCost(a=1.0, b=1e-4, c=2048.0))
    meter = BalanceMeter(2)
    record = record_from_rows([[0.0, 1.0, 1.0, 3, 100, 4000], [0.0, 0.5, 0.9, 1, 40, 1600]], num_samples=8)
    record.cost = fit.observe([100, 40], [4000, 1600], [3, 1], [1.0, 0.5]).as_dict()
    meter.add(record)
    assert not record.cost["fitted"] and not any(k.startswith("odc/cost") for k in meter.summary())
