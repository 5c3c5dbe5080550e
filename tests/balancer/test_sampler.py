import json

import numpy as np
import pytest

from ds_odc.balancer.checks import DataError, check_label_lengths
from ds_odc.balancer.lengths import lengths_from_dataset, lengths_from_file, sq_lengths_from_dataset
from ds_odc.balancer.presets import get_preset
from ds_odc.balancer.sampler import BalancedBatchSampler, RankBatch

W, M = 4, 3
LENGTHS = get_preset("long-sft").sample(100, seed=7).tolist()


def _samplers(**kw):
    kw.setdefault("cost", "tokens")
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
    s = BalancedBatchSampler(LENGTHS, world_size=W, rank=0, minibatch_size=M, max_tokens=65536, drop_last=False,
                             cost="tokens")
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
                             planner=planner, cost="tokens").load_state_dict(state)


def test_lengths_from_dataset_and_file(tmp_path):
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4], [5, 6]], "length": [3, 1, 2]})
    assert lengths_from_dataset(ds).tolist() == [3, 1, 2]
    assert lengths_from_dataset(ds, column="length").tolist() == [3, 1, 2]
    assert lengths_from_dataset(ds.select([2, 0])).tolist() == [2, 3]  # in the dataset's (selected) row order
    assert lengths_from_dataset({"input_ids": [[1], [2, 3]]}).tolist() == [1, 2]
    packed = Dataset.from_dict({"input_ids": [[0] * 4, [0] * 3], "seq_lengths": [[4], [1, 2]]})
    assert sq_lengths_from_dataset(packed).tolist() == [16.0, 5.0]
    assert sq_lengths_from_dataset(packed.select([1])).tolist() == [5.0]

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


# -- data checked up front ---------------------------------------------------------------------------------------

def _sampler(lengths, **kw):
    kw.setdefault("cost", "tokens")
    return BalancedBatchSampler(lengths, world_size=2, rank=0, minibatch_size=2, max_tokens=100, seed=0, **kw)


def test_oversize_is_found_when_built_and_named_by_dataset_index():
    """The bad sample sits far from the first minibatch: the error comes at construction, before any step, and
    names its dataset index (not its position in a shuffled minibatch), its length, the budget and the ways out."""
    lengths = [50] * 1000
    lengths[777] = 150
    lengths[901] = 101
    with pytest.raises(DataError) as err:
        _sampler(lengths, describe_sample=lambda i: f"row {i} of the test set")
    msg = str(err.value)
    assert "dataset index 777 (row 777 of the test set) has 150 tokens" in msg
    assert "max_tokens=100" in msg and "2 such samples: 777, 901" in msg
    assert "oversize='truncate'" in msg and "oversize='skip'" in msg and "filter" in msg
    assert isinstance(err.value, ValueError)


def test_skip_and_truncate_are_counted_and_skip_keeps_minibatches_full():
    lengths = [50] * 40
    for i in (3, 17, 29):
        lengths[i] = 500
    skip = _sampler(lengths, oversize="skip")
    report = skip.data_report.as_dict()
    assert report["skipped_samples"] == 3 and report["first_skipped"] == [3, 17, 29]
    assert report["truncated_samples"] == 0
    assert len(skip) == 37 // 4
    trained = {i for s in (_sampler(lengths, oversize="skip", **{}),) for b in s for mb in b.microbatches for i in mb}
    assert not trained & {3, 17, 29}
    for batch in BalancedBatchSampler(lengths, world_size=2, rank=1, minibatch_size=2, max_tokens=100,
                                      oversize="skip", cost="tokens"):
        assert batch.num_samples == 4  # full minibatches: skipped samples never take a slot
    trunc = _sampler(lengths, oversize="truncate")
    assert trunc.data_report.as_dict()["truncated_samples"] == 3
    assert "3 samples truncated to max_tokens=100 (dataset indices 3, 17, 29)" in trunc.data_report.message()
    seen = [i for s in range(len(trunc)) for i in trunc.minibatch(s).truncated]
    assert sorted(seen) == [i for i in (3, 17, 29) if i in set(trunc.epoch_order()[:len(trunc) * 4].tolist())]


def test_empty_samples_and_empty_datasets_are_errors():
    lengths = [10] * 20
    lengths[13] = 0
    with pytest.raises(DataError, match="dataset index 13 has 0 tokens"):
        _sampler(lengths)
    with pytest.raises(DataError, match="fewer than one global minibatch of 4"):
        _sampler([10, 10, 10])
    with pytest.raises(DataError, match="after skipping 2 oversize samples"):
        _sampler([10, 10, 500, 500], oversize="skip")
    with pytest.raises(DataError, match="input_ids but 4 labels"):
        check_label_lengths([3, 5, 2], [3, 4, 2])


def test_ten_million_lengths_are_checked_in_seconds():
    import time

    lengths = np.full(10_000_000, 1000, dtype=np.int64)
    lengths[9_999_998] = 70_000
    started = time.perf_counter()
    with pytest.raises(DataError, match="dataset index 9999998"):
        BalancedBatchSampler(lengths, world_size=8, rank=0, minibatch_size=4, max_tokens=65536, cost="tokens")
    ok = BalancedBatchSampler(np.minimum(lengths, 65536), world_size=8, rank=0, minibatch_size=4, max_tokens=65536,
                              cost="tokens")
    assert len(ok) == 10_000_000 // 32
    assert time.perf_counter() - started < 20  # measured ~1 s; the bound only catches a per-sample Python loop
