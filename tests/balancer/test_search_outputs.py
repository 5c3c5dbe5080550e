"""The exchange search (``partitioner.search_from_heaviest``) is one loop behind two kinds of exchange: the
partitioner's item moves and swaps, and lb-mini's rebalancing of packed ranks (``whole.py``). Plans are a
deterministic function of their inputs that every rank computes alone, so a change to that loop must leave them as
they were: these seeded cases pin each planner's output (a digest of its microbatches, taken before the loop was
shared), and check that both kinds of exchange did change something here, so the pins cover the search."""

import hashlib
import json

import numpy as np

import ds_odc.balancer.partitioner as partitioner
import ds_odc.balancer.whole as whole
from ds_odc.balancer import partition, plan_minibatch
from ds_odc.balancer.cost import FittedCost, QuadraticCost

PINNED = {
    "partition/0": "49fb2ab4f00f327a",
    "partition/1": "d81aeda2d25caed7",
    "partition/2": "2cd7ece652e665ce",
    "partition/chunked": "d9dcca1a3be17dc5",
    "lb-mini/fitted/10000/0": "c3e525dff4383bb8",
    "lb-mini/fitted/10000/1": "6bcb47e6a5ee66dc",
    "lb-mini/quad/None/0": "8aa28b3e79764ee8",
    "lb-mini/tokens/10000/2": "f3d9b31eeb6011d1",
    "lb-micro/fitted/10000/0": "0dd0909b7f7ddd7a",
    "lb-micro/tokens/None/1": "b6dd60eb6808cc68",
    "lb-mini-sp/quad/10000/0": "92e40535da1dbf81",
    "lb-mini-sp/fitted/10000/3": "943b424bcb049395",
}
COSTS = {"tokens": "tokens", "fitted": FittedCost(1.0, 1e-4, 3000.0), "quad": QuadraticCost(a=1.0, b=1e-3)}


def _outputs(name: str):
    kind, *rest = name.split("/")
    if kind == "partition":
        if rest == ["chunked"]:  # above FREE_KK_MAX_ITEMS: the chunked start
            return partition(np.random.default_rng(7).integers(1, 20000, 3000).tolist(), 64)
        rng = np.random.default_rng(int(rest[0]))
        k = int(rng.integers(2, 40))
        n = int(rng.integers(k, 8 * k))
        c = rng.lognormal(6, 1.2, n).tolist()
        return [partition(c, k), partition(c, k, equal_size=True)]
    cost, budget, seed = rest
    rng = np.random.default_rng(100 + int(seed))
    W = int(rng.integers(2, 17))
    n = int(rng.integers(W, 12 * W))
    lengths = rng.integers(200, 9000, n).tolist()
    plan = plan_minibatch(lengths, W, planner=kind, max_tokens=None if budget == "None" else int(budget),
                          cost=COSTS[cost])
    return [plan.microbatches, [repr(s) for s in plan.splits]]


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def test_plans_are_unchanged_and_both_searches_ran(monkeypatch):
    exchanges = {"items": 0, "packed ranks": 0}

    def counting(kind, search):
        def counted(*args, **kwargs):
            steps = search(*args, **kwargs)
            exchanges[kind] += steps
            return steps
        return counted

    monkeypatch.setattr(partitioner, "search_from_heaviest",
                        counting("items", partitioner.search_from_heaviest))
    monkeypatch.setattr(whole, "search_from_heaviest", counting("packed ranks", whole.search_from_heaviest))
    changed = {name: _digest(_outputs(name)) for name in PINNED}
    assert changed == PINNED
    assert exchanges["items"] > 0 and exchanges["packed ranks"] > 0, exchanges
