import json

import numpy as np
import pytest

from ds_odc.balancer.presets import get_preset
from ds_odc.balancer.sampler import BalancedBatchSampler, RankBatch, lengths_from_dataset, lengths_from_file

W, M = 4, 3
LENGTHS = get_preset("long-sft").sample(100, seed=7).tolist()


def _samplers(**kw):
    return [
        BalancedBatchSampler(LENGTHS, world_size=W, rank=r, minibatch_size=M, max_tokens=65536, **kw)
        for r in range(W)
    ]


def test_ranks_partition_each_global_minibatch():
    samplers = _samplers(seed=5)
    assert len(samplers[0]) == 100 // (W * M) == 8
    per_rank = [list(s) for s in samplers]
    order = samplers[0].epoch_order()
    for step in range(8):
        batches = [per_rank[r][step] for r in range(W)]
        assert all(isinstance(b, RankBatch) and b.step == step for b in batches)
        got = sorted(i for b in batches for mb in b.microbatches for i in mb)
        assert got == sorted(order[step * W * M : (step + 1) * W * M].tolist())
        assert {b.num_samples for b in batches} == {W * M}
        assert {b.num_tokens for b in batches} == {sum(LENGTHS[i] for i in got)}
        for b in batches:
            assert all(sum(LENGTHS[i] for i in mb) <= 65536 for mb in b.microbatches)


def test_epochs_seeds_and_no_shuffle():
    s = _samplers(seed=5)[0]
    e0 = s.epoch_order(0)
    assert not np.array_equal(e0, s.epoch_order(1))
    assert np.array_equal(e0, _samplers(seed=5)[0].epoch_order(0))
    assert not np.array_equal(e0, _samplers(seed=6)[0].epoch_order(0))
    assert np.array_equal(_samplers(shuffle=False)[0].epoch_order(3), np.arange(100))


def test_drop_last_false_plans_the_remainder():
    s = BalancedBatchSampler(LENGTHS, world_size=W, rank=0, minibatch_size=M, max_tokens=65536, drop_last=False)
    assert len(s) == 9
    last = list(s)[-1]
    assert last.num_samples == 100 - 8 * W * M


@pytest.mark.parametrize("planner", ["lb-mini", "lb-micro", "local-sort"])
def test_exact_mid_epoch_resume(planner):
    ref = _samplers(seed=1, planner=planner)[2]
    ref.set_epoch(3)
    full = list(ref)
    run = _samplers(seed=1, planner=planner)[2]
    run.set_epoch(3)
    it = iter(run)
    head = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON checkpoint
    assert state["step"] == 3 and state["epoch"] == 3
    resumed = _samplers(seed=1, planner=planner)[2]
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    with pytest.raises(ValueError, match="world_size"):
        BalancedBatchSampler(LENGTHS, world_size=2, rank=0, minibatch_size=M, max_tokens=65536, seed=1,
                             planner=planner).load_state_dict(state)


def test_lengths_from_dataset_and_file(tmp_path):
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4], [5, 6]], "length": [3, 1, 2]})
    assert lengths_from_dataset(ds) == [3, 1, 2]
    assert lengths_from_dataset(ds, column="length") == [3, 1, 2]

    texts = ["a b c", "d", "e f g h", "i j"]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "d.parquet"))

    def tok(batch, add_special_tokens=True):
        return {"input_ids": [[0] * (len(t.split()) + int(add_special_tokens)) for t in batch]}

    assert lengths_from_file(str(jsonl), tok) == [4, 2, 5, 3]
    assert lengths_from_file(str(tmp_path / "d.parquet"), tok, text_field="body", batch_size=3,
                             add_special_tokens=False) == [3, 1, 4, 2]


def test_bad_sampler_arguments():
    with pytest.raises(ValueError, match="rank"):
        BalancedBatchSampler([1], world_size=2, rank=2, minibatch_size=1, max_tokens=10)
    with pytest.raises(ValueError, match="planner"):
        BalancedBatchSampler([1], world_size=1, rank=0, minibatch_size=1, max_tokens=10, planner="x")
