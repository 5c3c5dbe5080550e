"""OdcState, the object that owns the ODC step, driven directly: in this process at world size 1, and on 2 and 3 CPU
ranks without DeepSpeed's engine (a few seconds each)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ds_odc.config import OdcConfig
from _support.launch import launch
from ds_odc.zero.state import OdcState, Phase

from _state_case import full_values, push_grads, release, zero3_params

WORKER = Path(__file__).with_name("state_worker.py")


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=20))
    state = OdcState(OdcConfig(timeout_s=20))
    state.connect(torch.device("cpu"), None)
    params, flat = zero3_params(0, 1)
    state.place_trainable(params, flat)
    state.place_accumulator(params, sum(p.partition_numel() for p in params))
    yield state, params
    state.close()
    dist.destroy_process_group()


def test_one_rank_fetch_is_the_shard_itself_and_the_step_round_trips(one_rank):
    state, params = one_rank
    state.fetch(params).wait()
    for p, v in zip(params, full_values()):
        assert torch.equal(p.data, v)
        assert p.data.data_ptr() == p.ds_tensor.data_ptr()  # no copy at world size 1
    release(params)
    push_grads(state, [params], [torch.full(v.shape, 2.0) for v in full_values()])
    state.start_step()
    state.fence()
    assert torch.equal(state.accumulator.local, torch.full_like(state.accumulator.local, 2.0))
    state.publish()
    assert state.phase is Phase.IDLE and state.accumulator.local.abs().sum() == 0


def test_plans_are_built_once_per_fetch_group_and_bucket(one_rank):
    state, params = one_rank
    ones = [torch.ones(p.ds_shape) for p in params]
    for _ in range(3):
        push_grads(state, [params[:2], params[2:]], ones)
    assert len(state._fetch_plans) == 2 and len(state._push_plans) == 2


def test_unmanaged_accumulation_refuses_early_gradient_reads(one_rank):
    state, params = one_rank
    state.accumulation = lambda: ("unmanaged", False)
    push_grads(state, [params], [torch.ones(p.ds_shape) for p in params])
    with pytest.raises(Exception, match="managed_gradient_accumulation=false"):
        state.settle("a test read")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_fetch_push_fence_publish_on_several_ranks(nproc):
    result = launch(WORKER, nproc, timeout=120).check().result
    for rank, checks in enumerate(result["ranks"]):
        assert checks.pop("fetch_plans") == 4, (rank, checks)  # [:2] and [2:] to read, [:3] and [3:] to push
        assert all(checks.values()), (rank, checks)
