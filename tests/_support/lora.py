"""The checks of the LoRA tests, shared by tests/integrations/test_lora.py (CPU) and tests/gpu/test_lora_gpu.py: a
case is what tests/integrations/lora_worker.py reports for one trainer."""

from __future__ import annotations

from _support.tolerance import assert_within, compare, compare_logs

GRPO_SCALES = {"loss": 1.0, "kl": 1.0}  # sums of order-1 terms that nearly cancel: their rounding is their terms'
NOT_COMPARED = ("epoch", "step", "learning_rate")
DPO_REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")  # the policy's log-probs less the reference's
# beta times differences of summed log-probs of order 100 (margins: differences of those), which nearly cancel: their
# rounding is their terms', of order 1 and more.
DPO_SCALES = {key: 1.0 for key in DPO_REWARDS}


def logged_keys(logs: dict, *runs: str) -> list[str]:
    return sorted({k for run in runs for entry in logs[run] for k in entry} - set(NOT_COMPARED))


def check_equal_to_stock(case: dict, run: str = "odc", scales: dict | None = None) -> None:
    assert case["fp64_dtype"] == "torch.float64"
    logs = case["logs"]
    assert len(logs[run]) == len(logs["stock"]) == 4
    assert_within(compare(f"{run} adapters", case["adapters"][run], case["adapters"]["fp64"]),
                  *compare_logs(run, logs[run], logs["stock"], logs["fp64"], logged_keys(logs, run, "stock"),
                                scales=scales))


def check_only_adapters_pushed(pushes: dict) -> None:
    # Every trainable parameter (the adapters) pushed its gradients, and nothing else did; the accumulator peers push
    # into holds exactly this rank's shards of the adapters, while the frozen base model is read, never written.
    assert pushes["pushed"] == pushes["trainable"], (pushes["pushed"], pushes["trainable"])
    assert pushes["trainable"] and all("lora_" in name for name in pushes["trainable"]), pushes["trainable"]
    assert pushes["accumulator"] == pushes["trainable_shards"], pushes
    assert pushes["frozen_shards"] > 10 * pushes["accumulator"], pushes


def uneven(counts: list[list]) -> bool:
    return any(len(set(step)) > 1 for step in counts)
