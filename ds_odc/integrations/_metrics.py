"""Balance metrics for trainer logs (``odc/*``): the steps of one logging window, as :mod:`ds_odc.training.metrics` counts
them (the same busy time, step time and bubble as ``examples/sft.py``), plus the automatic cost's coefficients
and its predicted against measured step time, and for RL the generation phase."""

from __future__ import annotations

from ds_odc.training.metrics import StepRecord, bubble_rate

__all__: list[str] = []


class BalanceMeter:
    def __init__(self, world_size: int, per_rank_limit: int = 16) -> None:
        self.world_size = int(world_size)
        self.per_rank_limit = per_rank_limit  # above this many ranks, log min/max only (keeps logs readable)
        self.data: dict[str, float] = {}  # logged once, with the first window (e.g. oversize counts)
        self.reset()

    def reset(self) -> None:
        self.records: list[StepRecord] = []
        self.generation: list[tuple[float, int]] = []

    def add(self, record: StepRecord, generation: tuple[float, int] | None = None) -> None:
        """One optimizer step (every rank adds the same gathered record). ``generation``: the slowest rank's
        generation seconds and all ranks' new tokens since the previous step, for trainers that generate."""
        self.records.append(record)
        if generation is not None:
            self.generation.append(generation)

    def summary(self) -> dict[str, float]:
        """Metrics of the steps since the last :meth:`reset` (empty if none)."""
        steps = self.records
        total = sum(r.step_time_s for r in steps)
        if not steps or total <= 0:
            return {}
        n, W = len(steps), self.world_size
        mbs = [sum(r.per_rank[k].microbatches for r in steps) / n for k in range(W)]
        out = {
            "odc/bubble": bubble_rate(steps),
            "odc/samples_per_second": sum(r.num_samples for r in steps) / total,
            "odc/tokens_per_second": sum(p.tokens for r in steps for p in r.per_rank) / total,
            "odc/step_seconds": total / n,
            "odc/busy_seconds_max_rank": max(sum(r.per_rank[k].busy_s for r in steps) for k in range(W)) / n,
            "odc/step_wait_seconds": sum(p.wait_s for r in steps for p in r.per_rank) / (n * W),
            "odc/step_wait_seconds_max_rank": max(p.wait_s for r in steps for p in r.per_rank),
            "odc/microbatches_min_rank": min(mbs),
            "odc/microbatches_max_rank": max(mbs),
        }
        if W <= self.per_rank_limit:
            out.update({f"odc/microbatches_rank{k}": mbs[k] for k in range(W)})
        costs = [r.cost for r in steps if r.cost and r.cost["fitted"]]  # none logged while the prior plans
        if costs:
            last = costs[-1]
            out.update({"odc/cost_a": last["a"], "odc/cost_b": last["b"], "odc/cost_c": last["c"]})
            predicted = [c for c in costs if c.get("predicted_step_s") is not None]
            if predicted:
                out["odc/cost_predicted_busy_seconds"] = sum(c["predicted_step_s"] for c in predicted) / len(predicted)
                out["odc/cost_measured_busy_seconds"] = sum(c["measured_step_s"] for c in predicted) / len(predicted)
        seconds = sum(s for s, _ in self.generation)
        if seconds > 0:
            out["odc/generation_seconds"] = seconds / n
            out["odc/generation_tokens_per_second"] = sum(t for _, t in self.generation) / seconds
        if self.data:
            out.update(self.data)
            self.data = {}
        return out
