"""Preference pairs as one ODC microbatch's rows (ds_odc.integrations._pairs), single process: the padding-free row
holds TRL's padded rows' tokens, and any subset of its pairs comes back as the batch TRL's collator makes of it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from trl.trainer.dpo_trainer import DataCollatorForPreference  # noqa: E402

from ds_odc.integrations._pairs import PAIRS_KEY, PairCollator, ServedOutputs  # noqa: E402

SAMPLES = [
    {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10]},
    {"prompt_ids": [], "chosen_ids": [11, 12, 13], "rejected_ids": [14, 15]},  # no prompt: its first token is unscored
    {"prompt_ids": [16], "chosen_ids": [17], "rejected_ids": [18, 19, 20, 21]},
]


def test_packed_row_holds_the_padded_rows():
    collate = DataCollatorForPreference(pad_token_id=0)
    padded, packed = collate(SAMPLES), PairCollator(collate, packed=True)(SAMPLES)
    real = padded["attention_mask"].bool()
    assert torch.equal(packed["input_ids"][0], padded["input_ids"][real])
    lengths = real.sum(1).tolist()  # chosen sequences, then rejected ones
    assert packed[PAIRS_KEY].lengths == tuple(lengths) and packed[PAIRS_KEY].pairs == 3
    assert packed["cu_seq_lens_q"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert packed["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    # Labels: the completion tokens, less each sequence's first token (position 0 of a padded row is never scored).
    expected = padded["input_ids"].masked_fill(padded["completion_mask"] == 0, -100)
    expected[:, 0] = -100
    assert torch.equal(packed["labels"][0], expected[real])


@pytest.mark.parametrize("packed", [True, False])
def test_a_subset_of_pairs_is_what_trl_collates_of_it(packed):
    collate = DataCollatorForPreference(pad_token_id=0)
    inputs = PairCollator(collate, packed=packed)(SAMPLES)
    rows = inputs[PAIRS_KEY]
    shape = inputs["input_ids"].shape
    scores = torch.arange(1.0, shape[0] * (shape[1] - 1) + 1).reshape(shape[0], shape[1] - 1)
    batch, outputs = rows.select(inputs, [2, 0], {"log_probs": scores})
    alone = collate([SAMPLES[2], SAMPLES[0]])
    width = alone["input_ids"].shape[1]
    for key in ("input_ids", "attention_mask", "completion_mask"):
        got = batch[key][:, :width] if not packed else batch[key]
        assert torch.equal(got, alone[key]), key
    # Each selected sequence's outputs are its own, from its first position (zero past its end when packed).
    lengths = alone["attention_mask"].sum(1).tolist()
    sequences = [2, 0, 3 + 2, 3 + 0]  # chosen of pairs 2 and 0, then their rejected
    for row, (sequence, n) in enumerate(zip(sequences, lengths)):
        if packed:
            start = int(inputs["cu_seq_lens_q"][sequence])
            assert torch.equal(outputs["log_probs"][row, :n - 1], scores[0, start:start + n - 1])
            assert (outputs["log_probs"][row, n - 1:] == 0).all()
        else:
            assert torch.equal(outputs["log_probs"][row], scores[sequence])
    served = ServedOutputs(**outputs)
    assert served(batch["input_ids"]) is served
    with pytest.raises(RuntimeError, match="served per-token outputs"):
        served(batch["input_ids"][:1])
