"""Compiled blocks (ds_odc/training/compile.py) and the fused-loss head (ds_odc/training/kernels.py) on CPU.

In process: a compiled model equals its eager self (packed rows through ``ds_odc_varlen``, activation checkpointing,
the chunked loss), compiles its block once whatever the number of layers, does not compile again for new packed
lengths, and falls back to eager with one warning where compiling fails. Across 2 CPU ranks (compile_worker.py):
ODC with compiled blocks and uneven microbatch counts against eager stock ZeRO-3, and a loss that reads
``lm_head.weight`` outside any module forward (as Liger's fused cross-entropy does) under ODC and stock ZeRO-3.

Backend ``aot_eager``: dynamo and AOTAutograd trace and split the graphs exactly as for inductor, without generating
code (inductor works on CPU too but compiles for minutes on a 2-core machine). tests/gpu runs inductor.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from _support.launch import launch
from ds_odc.training import attention  # noqa: F401  (registers ds_odc_varlen)
from ds_odc.training.collate import PackedCollator
from ds_odc.training.compile import (CompileOptions, compile_blocks, compile_blocks_on_engine_compile, compile_counts,
                                    compiled_blocks_of)
from ds_odc.training.kernels import Kernels, kernels_from_training_args, training_args_for_kernels
from ds_odc.training.loss import use_chunked_loss

WORKER = Path(__file__).with_name("compile_worker.py")
AOT = CompileOptions(backend="aot_eager")


def tiny(layers: int = 2, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, use_cache=False,
                         attn_implementation="ds_odc_varlen")
    model = Qwen2ForCausalLM(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    use_chunked_loss(model, chunk_tokens=16)
    return model


def rows(steps: int, seed: int = 0):
    """Packed rows of 3 documents, longer at every step: no two rows have the same length or the same documents."""
    g, collate = torch.Generator().manual_seed(seed), PackedCollator()
    for step in range(steps):
        lengths = torch.randint(4, 12 + 6 * step, (3,), generator=g).tolist()
        yield collate([{"input_ids": torch.randint(0, 128, (n,), generator=g)} for n in lengths])


def train_grads(model, steps: int):
    """Per step: the loss and the gradients of one packed row; and dynamo's counters after each step."""
    out, counts = [], []
    for row in rows(steps):
        model.zero_grad(set_to_none=True)
        loss = model(**row).loss
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        counts.append(compile_counts())
    return out, counts


def test_compiled_blocks_equal_eager_and_do_not_compile_again():
    torch._dynamo.reset()
    eager, _ = train_grads(tiny(), 4)
    model = tiny()
    state = compile_blocks(model, AOT)
    assert state.compiled and len(state.blocks) == 2 and compiled_blocks_of(model) is state
    assert compile_blocks(model, AOT) is state  # idempotent
    assert {type(b).__name__ for b in state.blocks} == {"Qwen2DecoderLayer"}  # same name: name-based settings hold
    before = compile_counts()
    compiled, counts = train_grads(model, 4)
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, compiled):
        assert torch.allclose(loss_e, loss_c, rtol=1e-6, atol=1e-6)
        for a, b in zip(grads_e, grads_c):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
    first = counts[0] - before
    assert first.graphs > 0 and first.frames > 0, first  # something was compiled
    assert counts[1] == counts[-1], counts  # new packed lengths after the second row: nothing compiled again
    # the packed attention runs outside the graph on CPU (its per-document kernel reads lengths on the host)
    assert first.graph_breaks > 0


def test_rows_of_one_document_and_of_several_share_the_graphs():
    """A row of one document first (2 boundaries, as many as the model's key heads; its attention output a view of
    the kernel's), then rows of several and of one again: nothing compiles after the first row."""
    torch._dynamo.reset()
    model = tiny()
    compile_blocks(model, AOT)
    g, collate, frames = torch.Generator().manual_seed(0), PackedCollator(), []
    for lengths in ([40], [10, 7], [25], [9, 3, 14], [33]):
        row = collate([{"input_ids": torch.randint(0, 128, (n,), generator=g)} for n in lengths])
        model(**row).loss.backward()
        frames.append(compile_counts().frames)
    assert frames[0] > 0 and frames[-1] == frames[0], frames


def test_every_layer_shares_one_compiled_block():
    """A 3-layer model compiles exactly what a 1-layer model compiles: no per-layer recompilation (which the cache
    limit of 8 would turn into eager layers on a 28-layer model)."""
    frames = []
    for layers in (1, 3):
        torch._dynamo.reset()
        before = compile_counts()
        model = tiny(layers)
        compile_blocks(model, AOT)
        train_grads(model, 1)
        frames.append((compile_counts() - before).frames)
    assert frames[0] == frames[1] > 0, frames


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no compiler here")


def test_a_failing_backend_says_so_once_and_runs_eager():
    torch._dynamo.reset()
    eager, _ = train_grads(tiny(), 2)
    model = tiny()
    state = compile_blocks(model, CompileOptions(backend=_failing_backend))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback, _ = train_grads(model, 2)
    said = [w for w in caught if "run eagerly" in str(w.message)]
    assert len(said) == 1 and "no compiler here" in str(said[0].message), [str(w.message) for w in caught]
    assert not state.compiled and "no compiler here" in state.describe()
    for (loss_e, grads_e), (loss_f, grads_f) in zip(eager, fallback):
        assert torch.equal(loss_e, loss_f)
        assert all(torch.equal(a, b) for a, b in zip(grads_e, grads_f))


def test_errors_raised_while_tracing_count_as_compile_failures():
    """dynamo raises some of its own failures as plain exceptions noting the user frame it traced (an
    AssertionError on Liger's patched layers, seen with torch 2.11): those fall back to eager too; an error raised
    by running code does not."""
    import traceback
    from ds_odc.training.compile import _failure_reason, _is_compile_failure
    traced = AssertionError("\n\nfrom user code:\n  File ...")
    traced.innermost_user_frame_summary = traceback.FrameSummary("liger_kernel/rms_norm.py", 7, "forward",
                                                                line="return LigerRMSNormFunction.apply(x)")
    assert _is_compile_failure(traced) and not _is_compile_failure(AssertionError("a model's own check"))
    assert "while tracing liger_kernel/rms_norm.py:7 (return LigerRMSNormFunction.apply(x))" in _failure_reason(traced)


def test_a_model_without_blocks_says_so_and_stays_as_it_is():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="no transformer block classes"):
        state = compile_blocks(model, AOT)
    assert not state.compiled and state.blocks == []
    assert type(model[0]) is torch.nn.Linear


def test_kernel_choices_and_trainer_arguments():
    assert Kernels.from_name("eager") == Kernels()
    both = Kernels.from_name("compiled+fused")
    assert both.name == "compiled+fused" and both.compile == CompileOptions() and both.liger
    assert both.liger_config() == {"rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False,
                                   "fused_linear_cross_entropy": True}
    assert Kernels.from_name("fused").liger_config()["rms_norm"] is True
    with pytest.raises(ValueError, match="choose one of"):
        Kernels.from_name("fast")
    from transformers import TrainingArguments
    args = TrainingArguments(output_dir="unused", torch_compile=True, use_liger_kernel=True,
                             liger_kernel_config={"swiglu": True}, report_to=[])
    kernels = kernels_from_training_args(args)
    assert kernels.compile == CompileOptions(backend="inductor") and kernels.liger
    given = training_args_for_kernels(args)
    assert given.liger_kernel_config == {"rope": False, "rms_norm": False, "swiglu": True}  # the user's key stays
    assert args.liger_kernel_config == {"swiglu": True}  # the caller's arguments are left as given
    eager = TrainingArguments(output_dir="unused", use_liger_kernel=True, report_to=[])
    assert training_args_for_kernels(eager) is eager


def test_engine_compile_compiles_the_blocks():
    """What Accelerate calls for TrainingArguments(torch_compile=True): engine.compile(backend, compile_kwargs)."""
    import types
    engine = types.SimpleNamespace(module=tiny())
    compile_blocks_on_engine_compile(engine)
    state = engine.compile(backend="aot_eager", compile_kwargs={"mode": None, "dynamic": None})
    assert state.compiled and state.options == AOT and compiled_blocks_of(engine.module) is state


# -- across ranks ------------------------------------------------------------------------------------------------------

def run(*args, timeout=600):
    return launch(WORKER, 2, [str(a) for a in args], timeout=timeout).check().result


@pytest.mark.slow
def test_compiled_odc_with_uneven_counts_equals_eager_stock_zero3():
    """ODC with compiled blocks (rank 0 trains 3 packed rows, rank 1 one) and stock ZeRO-3 with the same leaf modules
    compiled, against eager stock ZeRO-3 (2 rows each) on the same global minibatches: the same parameters up to
    fp32 rounding, and nothing compiled after the first minibatch although every minibatch has new lengths."""
    r = run("compiled", "--stock-compiled")
    assert "aot_eager" in r["compiled"], r["compiled"]
    assert r["odc_vs_stock"] < 1e-5, r  # measured 9e-8
    assert r["stock_compiled_vs_stock"] < 1e-5, r
    assert max(abs(a - b) for a, b in zip(r["loss_stock"], r["loss_odc"])) < 1e-5, r
    for counts in (r["counts"], r["stock_counts"]):
        assert counts[0]["graphs"] > 0 and counts[1] == counts[-1], counts


@pytest.mark.slow
@pytest.mark.parametrize("kernels,tied", [("fused", False), ("compiled+fused", True)])
def test_a_loss_reading_the_head_weight_directly_trains_under_odc_and_stock(kernels, tied):
    """Liger's access pattern (tests/training/_fused_standin.py): the head's weight read in the model's own forward,
    gradients computed in the forward. Under ODC (uneven counts) and stock ZeRO-3 it must train exactly as eager
    stock ZeRO-3 with the chunked loss; tied embeddings share that weight with the embedding."""
    r = run("fused", "--kernels", kernels, *(["--tied"] if tied else []))
    for name in ("odc", "stock_fused"):
        assert "error" not in r[name], r[name]
        assert r[name]["vs_stock"] < 1e-5, r  # measured 2e-7
        assert max(abs(a - b) for a, b in zip(r[name]["losses"], r["loss_stock"])) < 1e-5, r
        if kernels.startswith("compiled"):  # the loss's divisor reaches the blocks as a new float every minibatch
            counts = r[name]["counts"]
            assert counts[0]["graphs"] > 0 and counts[1] == counts[-1], counts


def test_sft_flags_choose_the_kernels():
    from ds_odc.recipes.sft import kernels_from_args, sft_argument_parser
    parse = sft_argument_parser(deepspeed_config=False).parse_args
    assert kernels_from_args(parse([])).name == "eager"
    assert kernels_from_args(parse(["--compile"])).name == "compiled"
    assert kernels_from_args(parse(["--compile", "--liger"])).name == "compiled+fused"
    assert kernels_from_args(parse(["--kernels", "fused", "--compile"])).name == "compiled+fused"
    chosen = kernels_from_args(parse(["--kernels", "compiled", "--compile-backend", "aot_eager"]))
    assert chosen.compile == AOT and not chosen.liger
