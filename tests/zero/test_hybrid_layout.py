"""Hybrid sharding's layout and its refusals, in this process (no ranks)."""

import pydantic
import pytest

import ds_odc  # noqa: F401  (installs the key)
from deepspeed.runtime.zero.config import get_zero_config

from ds_odc.zero.hybrid import ShardLayout, ranks_per_node, resolve_shard_size


def test_shard_size_key_accepts_a_count_or_node():
    def odc(value):
        return get_zero_config({"zero_optimization": {"stage": 3, "odc": {"shard_size": value}}}).odc
    assert odc(8).shard_size == 8 and odc("node").shard_size == "node"
    assert get_zero_config({"zero_optimization": {"stage": 3, "odc": True}}).odc.shard_size is None
    for bad in (0, -2, "rack", 2.5):
        with pytest.raises(pydantic.ValidationError, match="shard_size"):
            odc(bad)


def test_resolve_shard_size():
    assert resolve_shard_size(None, 16) == 16
    assert resolve_shard_size(4, 16) == 4
    assert resolve_shard_size("node", 16, local_size=8) == 8
    with pytest.raises(ValueError, match=r"shard_size=3 does not divide the 16 ranks.*\[1, 2, 4, 8, 16\]"):
        resolve_shard_size(3, 16)
    with pytest.raises(ValueError, match="does not divide the 4 ranks"):
        resolve_shard_size(8, 4)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        resolve_shard_size("node", 16, local_size=None)


def test_ranks_per_node_from_the_launcher(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    assert ranks_per_node() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert ranks_per_node() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's wins
    assert ranks_per_node() == 8


def test_layout_of_rank_5_in_3_groups_of_4():
    layout = ShardLayout(world_size=12, shard_size=4, rank=5)
    assert (layout.replicas, layout.shard_index, layout.shard_rank, layout.hybrid) == (3, 1, 1, True)
    assert layout.shard_group_ranks() == [4, 5, 6, 7]
    assert layout.replica_group_ranks() == [1, 5, 9]
    assert not ShardLayout(8, 8, 3).hybrid
    with pytest.raises(ValueError):
        ShardLayout(12, 5, 0)
