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


def _relative_imports(path: pathlib.Path) -> list[ast.ImportFrom]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.level == 1]


def test_modules_import_no_private_name_and_no_circle():
    """Inside the package, a module imports only another's public names, and the imports form no circle (the
    contract, plan.py, sits below the planners; the registry, planners.py, above them)."""
    graph = {}
    for f in SOURCE.glob("*.py"):
        imports = _relative_imports(f)
        private = [(n.module, a.name) for n in imports for a in n.names if a.name.startswith("_")]
        assert not private, (f.name, private)
        graph[f.stem] = {n.module for n in imports if n.module}
    done, visiting = set(), []

    def visit(module):
        assert module not in visiting, f"import circle: {' -> '.join(visiting + [module])}"
        if module in done:
            return
        visiting.append(module)
        for dep in graph.get(module, ()):
            visit(dep)
        visiting.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_one_registry_names_the_planners():
    """Only the registry spells planner names; the sampler, the simulator and the split planner read it."""
    for name in ("sampler.py", "simulate.py", "sp.py", "whole.py"):
        tree = ast.parse((SOURCE / name).read_text())
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        named = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docstrings
                 and isinstance(n.value, str) and any(p in n.value for p in B.PLANNERS)]
        assert not named, (name, named)


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
