"""The minibatch tag and its check, in one process (the 3-rank runs are in test_skipped_step.py)."""

from types import SimpleNamespace

import pytest

from ds_odc.zero.engine import tag_minibatch
from ds_odc.zero.minibatch import MinibatchMismatch, MinibatchTag, check_same_minibatch
from ds_odc.zero.optimizer import OdcOptimizer


def test_a_tag_survives_the_meeting_text():
    for tag in [MinibatchTag(0, 5, 812), MinibatchTag(3, None, 7), MinibatchTag()]:
        assert MinibatchTag.decode(tag.encode()) == tag
    assert str(MinibatchTag(1, 2, 3)) == "epoch 1, step 2, 3 label tokens"


def mismatch(notes) -> MinibatchMismatch:
    with pytest.raises(MinibatchMismatch) as caught:
        check_same_minibatch({r: None if t is None else t.encode() for r, t in notes.items()}, rank=0)
    return caught.value


def test_same_tags_pass_and_the_odd_rank_is_named():
    check_same_minibatch({0: "0,1,30", 1: "0,1,30", 2: "0,1,30"}, rank=0)
    check_same_minibatch({0: None, 1: None}, rank=0)
    a, b = MinibatchTag(0, 1, 30), MinibatchTag(0, 2, 41)
    ahead = mismatch({0: a, 1: a, 2: b})
    assert ahead.ranks == [2] and "Rank 2 went past" in str(ahead) and "k == 0" in str(ahead), str(ahead)
    behind = mismatch({0: b, 1: b, 2: a})  # not a skip by rank 2: look at its loop
    assert behind.ranks == [2] and "Look at the loop of rank 2" in str(behind), str(behind)
    tie = mismatch({0: a, 1: b})  # two ranks: either may be wrong
    assert tie.ranks == [0, 1], str(tie)
    untagged = mismatch({0: a, 1: a, 2: None})
    assert untagged.ranks == [2] and "Rank 2 did not tag" in str(untagged), str(untagged)
    tokens = mismatch({0: a, 1: a, 2: MinibatchTag(0, 1, 31)})  # same position, another label count: other data
    assert tokens.ranks == [2] and "same minibatches" in str(tokens), str(tokens)


def test_tag_minibatch_reads_a_batch_and_ignores_engines_without_odc():
    told = []
    optimizer = object.__new__(OdcOptimizer)  # no DeepSpeed construction: only the state it tells
    optimizer.odc = SimpleNamespace(tag_minibatch=told.append)
    engine = SimpleNamespace(optimizer=optimizer)
    tag_minibatch(engine, SimpleNamespace(epoch=1, step=4, num_label_tokens=90))  # a RankBatch
    tag_minibatch(engine, SimpleNamespace(epoch=1, step=5), label_tokens=12)  # a trainer's pack, and a count
    tag_minibatch(engine, epoch=2, step=0)
    assert told == [MinibatchTag(1, 4, 90), MinibatchTag(1, 5, 12), MinibatchTag(2, 0, None)]
    tag_minibatch(SimpleNamespace(optimizer=object()), epoch=0, step=0)  # stock ZeRO-3: nothing to do
    tag_minibatch(SimpleNamespace(), epoch=0, step=0)
    assert len(told) == 3
