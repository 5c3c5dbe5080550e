"""Traffic between nodes and model-state memory per GPU (ds_odc.balancer.traffic), and the simulator's inter-node
term, against hand computations."""

import pytest

from ds_odc.balancer.cost import FittedCost
from ds_odc.balancer.simulate import main, simulate
from ds_odc.balancer.traffic import (Precision, InterNode, allreduce_bytes_per_node, internode_bytes_per_node,
                                     parameter_count, state_bytes_per_gpu)
from ds_odc.balancer.presets import MODEL_SHAPES


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-1.5b", "qwen2.5-7b"])
def test_parameter_count_is_what_transformers_builds(name):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**MODEL_SHAPES[name]))
    assert parameter_count(dict(MODEL_SHAPES[name], model_type="qwen2")) == sum(p.numel() for p in model.parameters())


def test_llama_without_biases():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    assert parameter_count(dict(shape, model_type="llama")) == sum(p.numel() for p in model.parameters())


def test_bytes_per_node_by_hand():
    P, G, b = 1000, 8, Precision()
    # 4 nodes: a quarter of every collective is local; 2 gathers (bf16) + 1 reduction (bf16) per microbatch
    assert internode_bytes_per_node("zero3", P, 4, G, 3.0) == pytest.approx(3 * 0.75 * P * (2 * 2 + 2))
    assert internode_bytes_per_node("odc", P, 4, G, 3.0) == pytest.approx(G * 3 * 0.75 * P * 6)
    # node-sharded: one ring all-reduce of the fp32 shards, whatever the microbatches
    for scheme in ("mics", "hybrid"):
        for mbs in (0.0, 1.0, 17.5):
            assert internode_bytes_per_node(scheme, P, 4, G, mbs) == pytest.approx(2 * 0.75 * P * 4)
    assert allreduce_bytes_per_node(P, 4, b) == pytest.approx(2 * 0.75 * P * 4)
    assert all(internode_bytes_per_node(s, P, 1, G, 2.0) == 0 for s in ("zero3", "odc", "mics", "hybrid"))
    with pytest.raises(ValueError, match="unknown scheme"):
        internode_bytes_per_node("fsdp", P, 4, G, 1.0)


def test_state_per_gpu():
    P = 8 * 1024
    assert state_bytes_per_gpu("odc", P, 4, 8) == state_bytes_per_gpu("zero3", P, 4, 8) == P * 18 / 32
    assert state_bytes_per_gpu("hybrid", P, 4, 8) == state_bytes_per_gpu("mics", P, 4, 8) == P * 18 / 8


def test_internode_term_seconds():
    net = InterNode(params=1000, ranks=32, gpus_per_node=8, bandwidth=1e3, sharding="flat")
    assert net.scheme("collective") == "zero3" and net.scheme("odc") == "odc" and net.scheme("odc-sp") == "odc"
    assert net.per_microbatch("collective") == pytest.approx(0.75 * 1000 * 6 / 1e3)
    assert net.per_microbatch("odc") == pytest.approx(8 * 0.75 * 1000 * 6 / 1e3)
    assert net.per_step("odc") == 0.0
    node = InterNode(params=1000, ranks=32, gpus_per_node=8, bandwidth=1e3, sharding="node")
    assert node.per_microbatch("odc") == 0.0 and node.per_step("odc") == pytest.approx(2 * 0.75 * 1000 * 4 / 1e3)
    with pytest.raises(ValueError, match="do not fill nodes"):
        InterNode(params=1, ranks=12, gpus_per_node=8, bandwidth=1.0)


def test_simulator_adds_the_term_to_the_same_plans():
    cost = FittedCost(a=1e-4, b=0.0, c=0.0)
    common = dict(ranks=16, minibatch_size=4, max_tokens=65536, cost=cost, steps=3, seed=0, oversize="truncate",
                  planners=("lb-micro", "lb-mini"), plan_cost="given")
    bare = simulate("long-sft", **common)
    node_net = InterNode(params=10**6, ranks=16, gpus_per_node=8, bandwidth=1e9, sharding="node")
    node = simulate("long-sft", internode=node_net, **common)
    flat_net = InterNode(params=10**6, ranks=16, gpus_per_node=8, bandwidth=1e9, sharding="flat")
    flat = simulate("long-sft", internode=flat_net, **common)
    for p in ("lb-micro", "lb-mini"):
        assert bare[p]["internode_time_per_rank"] == 0.0
        assert node[p]["step_time"] == pytest.approx(bare[p]["step_time"] + node_net.per_step("odc"))
        assert node[p]["internode_time_per_rank"] == pytest.approx(node_net.per_step("odc"))
    # flat: every microbatch slot (collectives) or every microbatch of the rank (ODC, G x the bytes) pays
    slots = bare["lb-micro"]["microbatches_per_rank_max"]
    assert flat["lb-micro"]["step_time"] == pytest.approx(bare["lb-micro"]["step_time"]
                                                          + slots * flat_net.per_microbatch("collective"))
    assert flat["lb-mini"]["step_time"] > bare["lb-mini"]["step_time"] + flat_net.per_microbatch("odc") - 1e-12


def test_simulator_command_line_names_what_the_term_needs(capsys):
    base = ["--preset", "long-sft", "--ranks", "16", "--minibatch-size", "4", "--max-tokens", "65536",
            "--steps", "2", "--plan-cost", "given", "--inter-node-gbs", "400"]
    with pytest.raises(SystemExit):
        main(base + ["--cost", "quadratic", "--model-config", "qwen2.5-1.5b"])  # FLOPs, not seconds
    assert "--tflops" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--cost", "fitted", "--cost-coeffs", "0,1e-9,0.1"])
    assert "--model-config" in capsys.readouterr().err
    assert main(base + ["--cost", "quadratic", "--model-config", "qwen2.5-1.5b", "--tflops", "300",
                        "--sharding", "node"]) == 0
    out = capsys.readouterr().out
    assert "inter-node=400 GB/s/node sharding=node G=8" in out and "inter-node" in out.splitlines()[1]
