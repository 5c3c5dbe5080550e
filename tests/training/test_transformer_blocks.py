"""What a transformer block is (ds_odc/training/blocks.py), the one rule of ODC's block fetch and compiled blocks:
classes named in ``_no_split_modules`` and classes derived from them, outermost only; no DeepSpeed needed."""

import subprocess
import sys

import torch

from ds_odc.training.blocks import block_classes, transformer_blocks


class Block(torch.nn.Module):
    def __init__(self, inner: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.nested = Block() if inner else None


class Model(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(inner=True), Block()])


def test_named_and_derived_classes_are_blocks_and_only_the_outermost():
    model = Model()
    assert block_classes(model) == {"Block"}
    assert transformer_blocks(model) == list(model.layers)  # the nested Block is part of the first
    # re-classed as FSDP2's fully_shard does (a subclass with another name): still a block
    model.layers[1].__class__ = type("FSDPBlock", (Block,), {})
    assert transformer_blocks(model) == list(model.layers)
    assert transformer_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


def test_blocks_and_compiled_blocks_import_no_deepspeed():
    code = ("import sys, ds_odc.training.blocks, ds_odc.training.compile; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed' or m.startswith('ds_odc.zero')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
