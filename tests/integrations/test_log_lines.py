"""The examples' console logs: one short line per logging step (ds_odc.integrations.log_lines), not the whole dict."""

import pytest

from ds_odc.integrations.log_lines import LogLines, log_line, show_log_lines

# A 2-rank ODC + LB-Mini DPO step's log as the Trainer prints it with the progress bar off (keys as logged).
DPO_STEP = {"loss": 0.656, "grad_norm": 2.1507, "learning_rate": 0.0033333, "rewards/chosen": 0.0123,
            "rewards/rejected": -0.0311, "rewards/accuracies": 0.8125, "rewards/margins": 0.0434,
            "logps/chosen": -101.23, "logps/rejected": -99.87, "logits/chosen": -0.0123, "logits/rejected": -0.0141,
            "num_tokens": 5120.0, "odc/bubble": 0.0301, "odc/samples_per_second": 115.2, "odc/tokens_per_second": 9123.4,
            "odc/step_seconds": 0.139, "odc/busy_seconds_max_rank": 0.12, "odc/step_wait_seconds": 0.0042,
            "odc/step_wait_seconds_max_rank": 0.0071, "odc/microbatches_min_rank": 1.0, "odc/microbatches_max_rank": 2.0,
            "odc/microbatches_rank0": 1.0, "odc/microbatches_rank1": 2.0, "odc/cost_a": 1.2e-05, "odc/cost_b": 3.4e-09,
            "odc/cost_c": 0.0021, "odc/cost_predicted_busy_seconds": 0.118, "odc/cost_measured_busy_seconds": 0.12,
            "epoch": 0.25}


def test_a_step_is_one_short_line_of_the_numbers_to_watch():
    assert len(str(DPO_STEP)) > 800  # with the digits real values carry: about 1,000
    line = log_line(DPO_STEP, 2, 10, extra=("rewards/accuracies",))
    assert line == ("step 2/10  loss 0.6560  grad_norm 2.151  lr 3.33e-03  rewards/accuracies 0.8125  samples/s 115  "
                    "odc wait 0.004 s/step (bubble 3.0%)"), line
    stock = {k: v for k, v in DPO_STEP.items() if not k.startswith("odc/")}  # stock ZeRO-3: no ODC numbers
    assert log_line(stock, 2, 10) == "step 2/10  loss 0.6560  grad_norm 2.151  lr 3.33e-03"
    summary = {"train_runtime": 12.34, "train_samples_per_second": 5.2, "train_steps_per_second": 0.3,
               "total_flos": 1e9, "train_loss": 0.7, "epoch": 1.0}
    assert log_line(summary, 10, 10) == "train: 10 steps in 12.3 s  samples/s 5.2  mean loss 0.7000"
    assert log_line({"eval_loss": 0.5, "epoch": 1.0}, 4, 10) == "step 4  eval_loss 0.5000  epoch 1.000"


def test_it_takes_the_place_of_the_trainers_printing(tmp_path, capsys):
    import torch
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    args = TrainingArguments(output_dir=str(tmp_path), disable_tqdm=True, report_to=[], use_cpu=True)
    trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
    kinds = lambda: [type(c) for c in trainer.callback_handler.callbacks]  # noqa: E731
    assert PrinterCallback in kinds()
    show_log_lines(trainer, extra=("reward",))
    assert PrinterCallback not in kinds() and LogLines in kinds()
    trainer.state.global_step, trainer.state.max_steps = 1, 3
    trainer.log({"loss": 1.5, "reward": 0.25})
    assert capsys.readouterr().out.splitlines()[-1] == "step 1/3  loss 1.5000  reward 0.2500"
