import dataclasses
import pathlib

import pytest

import ds_odc.balancer as B


def test_public_names():
    for name in B.__all__:
        assert getattr(B, name) is not None
    assert B.PLANNERS == ("local-sort", "lb-micro", "lb-mini")


def test_plan_is_frozen_and_rank_batch_is_a_dataclass():
    plan = B.plan_minibatch([3, 1, 2], 2, planner="lb-mini", max_tokens=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tokens = 0
    assert dataclasses.is_dataclass(B.RankBatch)
    assert plan.planner == "lb-mini" and plan.num_samples == 3 and plan.num_tokens == 6


def test_no_torch_distributed_in_balancer():
    src = pathlib.Path(B.__file__).parent
    for f in src.glob("*.py"):
        text = f.read_text()
        for pattern in ("import torch.distributed", "from torch.distributed", "torch.distributed.",
                        "from torch import distributed"):
            assert pattern not in text, (f, pattern)
    # torch only in the collator
    users = sorted(f.name for f in src.glob("*.py") if "import torch" in f.read_text())
    assert users == ["collate.py"]
