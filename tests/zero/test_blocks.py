"""The fetch unit (ds_odc/zero/blocks.py), in process: the model's blocks (ds_odc/training/blocks.py) become leaf
modules, and their inputs get a gradient."""

import torch

import ds_odc  # noqa: F401
from deepspeed.runtime.zero.config import get_zero_config
from deepspeed.utils import z3_leaf_module

from ds_odc.training.blocks import transformer_blocks
from ds_odc.zero.blocks import fetch_by_block


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, hidden_states, scale=None):
        self.seen = hidden_states.requires_grad
        return self.inner(hidden_states)


class Model(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4).requires_grad_(False)
        self.blocks = torch.nn.ModuleList([Block(), Block()])


def _zero(extra=None):
    return get_zero_config({"zero_optimization": {"stage": 3, "odc": True, **(extra or {})}})


def test_blocks_are_the_no_split_modules_and_become_leaves():
    model = Model()
    blocks = fetch_by_block(transformer_blocks(model), _zero(), "block")
    assert blocks == list(model.blocks) and all(z3_leaf_module(b) for b in model.blocks)
    assert not z3_leaf_module(model.blocks[0].inner)
    assert fetch_by_block(transformer_blocks(model), _zero(), "block") == []  # a second engine: flagged once


def test_module_unit_or_user_leaf_config_leave_the_model_alone():
    model = Model()
    assert fetch_by_block(transformer_blocks(model), _zero(), "module") == []
    chosen = _zero({"leaf_module": {"classes": ["Something"]}})
    assert fetch_by_block(transformer_blocks(model), chosen, "block") == [] and not z3_leaf_module(model.blocks[0])
    assert fetch_by_block(transformer_blocks(torch.nn.Linear(2, 2)), _zero(), "block") == []  # no blocks: per module


def test_a_block_input_without_grad_gets_one_positionally_or_by_keyword():
    model = Model()
    fetch_by_block(transformer_blocks(model), _zero(), "block")
    hidden = model.embed(torch.tensor([[1, 2]]))
    assert not hidden.requires_grad
    model.blocks[0](hidden)
    assert model.blocks[0].seen and not hidden.requires_grad  # a detached copy, the caller's tensor is untouched
    model.blocks[1](hidden_states=hidden)
    assert model.blocks[1].seen
    with torch.no_grad():
        model.blocks[0](hidden)
    assert not model.blocks[0].seen
    model.eval()
    model.blocks[0](hidden)
    assert not model.blocks[0].seen
