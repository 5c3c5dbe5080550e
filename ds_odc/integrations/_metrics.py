"""Per-step balance metrics for trainer logs: bubble rate, throughput and microbatch counts per rank.

Each rank times its own forward/backward work (``busy``) and its whole step (first forward to the end of the
optimizer step, which includes waiting for the slowest rank at ODC's fence). One all-gather per step, at the step,
where every rank already is, brings every rank's numbers to every rank:

    bubble = 1 - sum_r busy_r / (W * step_time),   step_time = max_r step_r

Over a logging window the sums run over the window's steps as well, so the logged bubble is time-weighted.
"""

from __future__ import annotations

import torch

__all__ = ["BalanceMeter"]

_FIELDS = 4  # busy_s, step_s, microbatches, local tokens


class BalanceMeter:
    def __init__(self, world_size: int, per_rank_limit: int = 16) -> None:
        self.world_size = int(world_size)
        self.per_rank_limit = per_rank_limit  # above this many ranks, log min/mean/max only (keeps logs readable)
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.busy = torch.zeros(self.world_size, dtype=torch.float64)
        self.microbatches = torch.zeros(self.world_size, dtype=torch.float64)
        self.step_time = 0.0
        self.samples = 0
        self.tokens = 0

    def local_stats(self, busy_s: float, step_s: float, microbatches: int, tokens: int, device) -> torch.Tensor:
        return torch.tensor([busy_s, step_s, float(microbatches), float(tokens)], dtype=torch.float64, device=device)

    def add(self, gathered: torch.Tensor, num_samples: int, num_tokens: int) -> None:
        """``gathered``: every rank's :meth:`local_stats`, concatenated in rank order."""
        rows = gathered.detach().to("cpu", torch.float64).reshape(self.world_size, _FIELDS)
        self.steps += 1
        self.busy += rows[:, 0]
        self.step_time += float(rows[:, 1].max())
        self.microbatches += rows[:, 2]
        self.samples += int(num_samples)
        self.tokens += int(num_tokens)

    def summary(self) -> dict[str, float]:
        """Metrics of the steps since the last :meth:`reset` (empty if none)."""
        if self.steps == 0 or self.step_time <= 0:
            return {}
        W = self.world_size
        mbs = self.microbatches / self.steps
        out = {
            "odc/bubble": 1.0 - float(self.busy.sum()) / (W * self.step_time),
            "odc/samples_per_second": self.samples / self.step_time,
            "odc/tokens_per_second": self.tokens / self.step_time,
            "odc/step_seconds": self.step_time / self.steps,
            "odc/busy_seconds_max_rank": float(self.busy.max()) / self.steps,
            "odc/microbatches_min_rank": float(mbs.min()),
            "odc/microbatches_max_rank": float(mbs.max()),
        }
        if W <= self.per_rank_limit:
            out.update({f"odc/microbatches_rank{r}": float(mbs[r]) for r in range(W)})
        return out
