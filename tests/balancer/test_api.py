"""The balancer's public surface: what it exports, what it imports, and the normaliser every rank derives."""

import ast
import dataclasses
import pathlib

import pytest
import torch

import ds_odc.balancer as B
from ds_odc.balancer.presets import get_preset
from ds_odc.training.collate import PackedCollator
from ds_odc.training.loss import count_loss_tokens

SOURCE = pathlib.Path(B.__file__).parent


def test_every_export_exists_and_explains_itself():
    assert len(set(B.__all__)) == len(B.__all__)
    undocumented = [n for n in B.__all__ if not (getattr(B, n).__doc__ or "").strip()]
    assert not undocumented, f"public names without a docstring: {undocumented}"
    for name in ("AutoCost", "DataError", "BalancedBatchSampler", "plan_minibatch"):
        assert name in B.__all__


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_pure_python_no_communication():
    """Plans are computed locally on every rank: nothing in the package talks to other ranks, imports torch or
    DeepSpeed, or reaches up into the rest of ds_odc (the balancer is a leaf)."""
    for f in SOURCE.glob("*.py"):
        mods = _imports(f)
        assert not any(m.split(".")[0] in ("torch", "deepspeed", "transformers") for m in mods), (f.name, mods)
        assert not any(m.startswith("ds_odc.") and not m.startswith("ds_odc.balancer") for m in mods), (f.name, mods)


@pytest.mark.parametrize("planner,max_tokens,oversize", [("lb-mini", 600, "truncate"), ("lb-micro", 600, "error"),
                                                          ("local-sort", None, "error"), ("lb-mini", None, "error")])
def test_every_rank_derives_the_true_number_of_loss_terms(planner, max_tokens, oversize):
    """RankBatch.num_label_tokens, which each rank knows without communicating, equals the label tokens of the
    rows all ranks together collate for the minibatch (truncated samples counted at their trained length)."""
    lengths = (get_preset("baselines-longtail").sample(48, seed=3) // 40).clip(2, 800)
    if max_tokens is not None and oversize != "truncate":
        lengths = lengths.clip(2, max_tokens)
    lengths = lengths.tolist()
    samplers = [B.BalancedBatchSampler(lengths, world_size=3, rank=r, minibatch_size=4, max_tokens=max_tokens,
                                       planner=planner, cost="tokens", oversize=oversize) for r in range(3)]
    collate = PackedCollator()
    for step in range(len(samplers[0])):
        batches = [s.minibatch(step) for s in samplers]
        counted = 0
        for b in batches:
            for mb in b.microbatches:
                rows = [{"input_ids": torch.arange(min(lengths[i], max_tokens or lengths[i]))} for i in mb]
                counted += count_loss_tokens(collate(rows))
        assert {b.num_label_tokens for b in batches} == {counted}
    plan = B.plan_minibatch([3, 1, 2], 2, planner=planner, max_tokens=max_tokens)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tokens = 0
