"""``lb-mini-sp``: LB-Mini plus sequence parallelism for the few samples that no single rank can take.

When one sample costs more than a rank's fair share of the minibatch (``total cost / W``), the rank holding it sets
the step time whatever the other ranks do. ``lb-mini-sp`` gives such a sample to a *group* of ``g`` ranks that
train it together, each holding ``1/g`` of its tokens (Ulysses sequence parallelism: all-to-alls inside attention,
over that group only), and balances every other sample with LB-Mini around the groups' work.

Plan, deterministically and without communication (every rank computes the same one):

1. *Which samples split, and how wide.* Samples longer than ``max_tokens`` must split (each slice must fit the
   microbatch budget). Then, heaviest first, a sample splits when its cost exceeds the fair share the minibatch
   would have with it split (so splitting cannot lengthen the step by its own overhead), into the smallest ``g``
   whose per-member cost fits that fair share. ``g`` is a power of two that divides ``ranks_per_node`` and that the
   model's attention heads allow (:meth:`SplitPolicy.group_sizes`).
2. *Where.* Groups are aligned blocks of ranks (``[k*g, (k+1)*g)``), so a group never spans two nodes. Heaviest
   first, each split sample takes the aligned block that can start it soonest.
3. *When.* Every member trains its split samples first, in the plan's global order (:attr:`SplitPlan.splits`):
   two ranks that share several split samples meet for them in the same order, so nobody waits on a peer that
   waits on someone else, and no group can deadlock.
4. *The rest.* The other samples are balanced over all ranks counting each rank's split work as already
   assigned (greedy LPT from those loads, then the partitioner's exchange search), and packed per rank as LB-Mini
   packs.

With no sample worth splitting the plan is exactly LB-Mini's.

Cost of a split sample (per member): ``cost / (g * efficiency) + exchange + c``, where ``efficiency`` folds everything
that makes ``g`` ranks slower than ``1/g`` of one rank's time apart from the all-to-all bytes (smaller matmuls,
imperfect overlap, the per-layer position gather), and ``exchange`` is each member's all-to-all traffic: per layer
and per pass (forward, backward) the q, k, v and attention-output tensors of its ``L/g`` tokens, of which it sends
the fraction ``(g - 1) / g``, priced relative to the cost model's per-token term ``a`` (so it holds in any unit:
tokens, FLOPs, seconds); ``c`` is the cost model's fixed cost of a microbatch, which every member pays
in full. 0.8 is the default efficiency until it is measured on several GPUs
(docs/SEQUENCE_PARALLEL.md says how).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .cost import CostModel
from .packing import pack
from .partitioner import exchange_search
from .plan import Plan, SplitSample, checked_minibatch
from .whole import assign_lb_mini

__all__ = ["SplitPolicy", "SplitPlan", "plan_split", "longest_split_sample"]

DEFAULT_EFFICIENCY = 0.8
# Assumed H200 ratio of achieved bf16 training FLOP/s (~400 T) to all-to-all bytes/s per GPU inside one NVLink node
# (~150 G): what prices the exchange against compute. An estimate, not a measurement.
DEFAULT_FLOPS_PER_BYTE = 400e12 / 150e9
_MAX_EVALS_EXTRA = 64
_MAX_PARTNERS = 16


@dataclass(frozen=True)
class SplitPolicy:
    """How samples may be split, and what a split sample costs each member.

    Attributes:
        efficiency: a split sample's compute on ``g`` ranks takes ``1 / (g * efficiency)`` of its time on one
            (``0 < efficiency <= 1``).
        ranks_per_node: ranks that share a fast interconnect; a group size divides it, so aligned groups stay in
            one node.
        max_group_size: an extra cap on ``g`` (``None``: ``ranks_per_node``).
        num_attention_heads, num_key_value_heads: the model's; Ulysses gives each member ``heads / g`` query heads,
            so ``g`` must divide them, and either divide the KV heads or be a multiple of them (KV heads are then
            replicated, as DeepSpeed's ``UlyssesSPAttentionHF`` does). ``None``: no limit from the model.
        exchange_per_token: the all-to-all time of one token's q and attention-output tensors (all layers,
            forward and backward), as a multiple of that token's linear compute (the cost model's ``a``).
        exchange_per_kv_head: the same for k and v, per KV head (replicated heads count).
    """

    efficiency: float = DEFAULT_EFFICIENCY
    ranks_per_node: int = 8
    max_group_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    exchange_per_token: float = 0.0
    exchange_per_kv_head: float = 0.0

    def __post_init__(self):
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"SplitPolicy.efficiency must be in (0, 1], got {self.efficiency}")
        if self.ranks_per_node < 1:
            raise ValueError(f"SplitPolicy.ranks_per_node must be >= 1, got {self.ranks_per_node}")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and heads < 1 or kv is not None and kv < 1:
            raise ValueError(f"SplitPolicy: head counts must be positive, got {heads} query / {kv} KV heads")
        if min(self.exchange_per_token, self.exchange_per_kv_head) < 0:
            raise ValueError("SplitPolicy: exchange costs must be non-negative")

    @classmethod
    def from_hf_config(cls, config: Any, *, efficiency: float = DEFAULT_EFFICIENCY, ranks_per_node: int = 8,
                       max_group_size: int | None = None, dtype_bytes: int = 2,
                       flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE) -> "SplitPolicy":
        """The policy of a Hugging Face decoder config (or a dict with its keys): head limits from the config, and
        the exchange of its q/k/v/output tensors at ``dtype_bytes`` per element, each byte costing as much time as
        ``flops_per_byte`` FLOPs of training compute (default: H200 estimate; ``0`` ignores the exchange)."""
        from .cost import QuadraticCost
        get = (lambda k: config.get(k)) if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
        heads = int(get("num_attention_heads"))
        kv = int(get("num_key_value_heads") or heads)
        head_dim = int(get("head_dim") or int(get("hidden_size")) // heads)
        token_flops = QuadraticCost.from_hf_config(config).a  # a token's linear training compute
        per_element = 2 * int(get("num_hidden_layers")) * dtype_bytes * flops_per_byte / token_flops  # fwd + bwd
        return cls(efficiency=efficiency, ranks_per_node=ranks_per_node, max_group_size=max_group_size,
                   num_attention_heads=heads, num_key_value_heads=kv,
                   exchange_per_token=per_element * 2 * heads * head_dim,  # q and the attention output
                   exchange_per_kv_head=per_element * 2 * head_dim)  # k and v

    def head_limit(self, g: int) -> str | None:
        """Why the model cannot be split ``g`` ways (``None`` when it can)."""
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and heads % g:
            return f"{heads} query heads are not divisible by {g}"
        if kv is not None and kv % g and g % kv:
            return f"{kv} KV heads neither divide by {g} nor divide {g}"
        return None

    def group_sizes(self, world_size: int) -> tuple[int, ...]:
        """Allowed group sizes for ``world_size`` ranks, ascending: powers of two >= 2 that divide
        ``ranks_per_node``, are at most ``max_group_size`` and ``world_size``, and that the heads allow."""
        cap = min(world_size, self.ranks_per_node, self.max_group_size or self.ranks_per_node)
        sizes, g = [], 2
        while g <= cap:
            if self.ranks_per_node % g == 0 and self.head_limit(g) is None:
                sizes.append(g)
            g *= 2
        return tuple(sizes)

    def compute_share(self, g: int) -> float:
        """The fraction of a split sample's compute each of its ``g`` members spends: ``1 / (g * efficiency)``."""
        return 1.0 / (g * self.efficiency)

    def member_cost(self, cost: Any, length: Any, g: int, token_cost: float) -> Any:
        """Per-member cost of a sample of ``length`` tokens whose own cost (``a*L + b*S``, without the microbatch's
        fixed cost) is ``cost``, split ``g`` ways; ``token_cost`` is the cost model's ``a`` (vectorised over numpy
        arrays)."""
        kv = self.num_key_value_heads or 0
        per_token = token_cost * (self.exchange_per_token + self.exchange_per_kv_head * max(kv, g))
        return cost * self.compute_share(g) + (length / g) * ((g - 1) / g) * per_token


@dataclass(frozen=True)
class SplitPlan(Plan):
    """A :class:`~ds_odc.balancer.plan.Plan` whose split samples cost what :class:`SplitPolicy` says.

    A split sample appears as a one-sample microbatch in the list of every member, before the member's own
    microbatches, in the order of :attr:`splits` (the order every member runs them in). ``num_samples`` and
    ``num_tokens`` count it once, so the loss normalisers are those of any other plan of the minibatch.

    Attributes:
        split_limit: a sample longer than this (``max_tokens`` times the largest group size) was truncated to it.
        policy: the :class:`SplitPolicy` planned with.
    """

    split_limit: int | None = None
    policy: SplitPolicy = field(default_factory=SplitPolicy)

    @property
    def truncated_to(self) -> int | None:
        return self.split_limit

    def split_member_cost(self, split: SplitSample, cost: float, length: int, cost_model: CostModel) -> float:
        """Per member: its compute share, plus its part of the exchange (:meth:`SplitPolicy.member_cost`)."""
        return float(self.policy.member_cost(cost, length, split.size, cost_model.a))

    def split_compute_share(self, split: SplitSample) -> float:
        return self.policy.compute_share(split.size)


def longest_split_sample(max_tokens: int, world_size: int, policy: SplitPolicy) -> int:
    """The longest sample that ``lb-mini-sp`` trains whole: ``max_tokens`` per slice over its largest group."""
    return max_tokens * max(policy.group_sizes(int(world_size)), default=1)


def plan_split(
    lengths: Sequence[int],
    world_size: int,
    *,
    name: str,
    max_tokens: int | None = None,
    cost: "str | CostModel" = "tokens",
    oversize: str = "error",
    split: SplitPolicy | None = None,
    sq_lengths: Sequence[float] | None = None,
) -> SplitPlan:
    """Plan one minibatch with the split planner (see the module docstring); called as
    ``plan_minibatch(..., planner="lb-mini-sp", split=policy)``, whose arguments it takes (``name``: the planner's
    name in the plan; ``split``: the :class:`SplitPolicy`, default ``SplitPolicy()``).

    ``max_tokens`` bounds every microbatch, a split sample's slices included, so a sample of up to ``max_tokens``
    times the largest allowed group size is trained whole; ``oversize`` applies beyond that.
    """
    policy = split or SplitPolicy()
    W = int(world_size)
    sizes = policy.group_sizes(W)
    limit = None if max_tokens is None else longest_split_sample(max_tokens, W, policy)
    g_max = max(sizes, default=1)
    why = (f"so even split over at most {g_max} ranks (world size {world_size}, ranks_per_node "
           f"{policy.ranks_per_node}" + (f", max_group_size {policy.max_group_size}" if policy.max_group_size else "")
           + f"{_head_note(policy, W)}) its slices exceed max_tokens={max_tokens}; allowing larger "
           "groups is another way out")
    m = checked_minibatch(lengths, W, max_tokens, cost, oversize, sq_lengths, limit, why)
    cm, active, act_lens, act_sq, costs = m.cost, m.active, m.lengths, m.sq_lengths, m.costs
    fixed = cm.per_microbatch
    widths = _choose_widths(act_lens, costs, fixed, float(cm.a), W, max_tokens, sizes, policy)

    common = dict(num_samples=int(active.size), num_tokens=int(act_lens.sum()), planner=name,
                  max_tokens=max_tokens, truncated=m.truncated, skipped=m.skipped, split_limit=limit, policy=policy)
    act = active.tolist()
    if not widths:  # nothing worth splitting: exactly LB-Mini (every sample fits max_tokens here)
        base = assign_lb_mini(act_lens.tolist(), costs.tolist(), fixed, W, max_tokens)
        return SplitPlan(microbatches=[[[act[j] for j in mb] for mb in rank] for rank in base], **common)

    member = {j: float(policy.member_cost(costs[j], act_lens[j], g, cm.a)) + fixed for j, g in widths.items()}
    order = sorted(widths, key=lambda j: (-member[j], j))
    ready = np.zeros(W)
    splits, first = [], [[] for _ in range(W)]
    for j in order:
        g = widths[j]
        blocks = ready[: (W // g) * g].reshape(-1, g)
        starts = blocks.max(axis=1)
        soonest = np.flatnonzero(starts == starts.min())
        # then the least idle time before the start (ready times closest to it), then the lowest ranks
        b = int(soonest[0] if soonest.size == 1 else soonest[np.argmin(-blocks[soonest].sum(axis=1))])
        ranks = tuple(range(b * g, (b + 1) * g))
        ready[b * g:(b + 1) * g] = starts[b] + member[j]
        splits.append(SplitSample(act[j], ranks))
        for r in ranks:
            first[r].append([act[j]])

    rest = [j for j in range(active.size) if j not in widths]
    # As lb-mini counts them: a sample alone in its microbatch pays the fixed cost, a packed one its token share.
    share = np.ones(active.size) if max_tokens is None else act_lens / max_tokens
    shares = _balance_around([float(costs[j] + fixed * share[j]) for j in rest], ready.tolist())
    microbatches = []
    for r in range(W):
        mine = [rest[k] for k in shares[r]]
        local = pack(mine, act_lens, max_tokens, None, cm, sq_lengths=act_sq) if mine else []
        microbatches.append(first[r] + [[act[j] for j in mb] for mb in local])
    return SplitPlan(microbatches=microbatches, splits=tuple(splits), **common)


def _head_note(policy: SplitPolicy, W: int) -> str:
    g = 2
    while g <= min(W, policy.ranks_per_node, policy.max_group_size or W):
        why = policy.head_limit(g)
        if why:
            return f"; not {g}: {why}"
        g *= 2
    return ""


def _choose_widths(lens: np.ndarray, costs: np.ndarray, fixed: float, a: float, W: int, max_tokens: int | None,
                   sizes: tuple[int, ...], policy: SplitPolicy) -> dict[int, int]:
    """``{position: g}`` of the samples to split (see step 1 of the module docstring). Costs are the samples' own;
    every microbatch, a member's share of a split sample included, adds ``fixed``."""
    if not sizes or lens.size == 0:
        return {}
    cost_of, length_of = costs.tolist(), lens.tolist()

    def spent(j: int, g: int) -> float:  # device time a sample takes over all the ranks that train it
        return cost_of[j] + fixed if g == 1 else g * (policy.member_cost(cost_of[j], length_of[j], g, a) + fixed)

    widths: dict[int, int] = {}
    if max_tokens is not None:  # too long for one microbatch: the smallest group whose slices fit
        for j in np.flatnonzero(lens > max_tokens).tolist():
            widths[j] = next(g for g in sizes if -(-int(lens[j]) // g) <= max_tokens)
    total = float(costs.sum()) + fixed * lens.size + sum(spent(j, g) - spent(j, 1) for j, g in widths.items())
    for j in sorted(range(lens.size), key=lambda j: (-cost_of[j], j)):
        c, L, g_min = cost_of[j] + fixed, length_of[j], widths.get(j, 1)
        if g_min == 1 and c * W <= total:  # no heavier than the fair share: stays whole
            continue
        chosen = None
        for g in (g for g in sizes if g >= max(g_min, 2)):
            m = policy.member_cost(cost_of[j], L, g, a) + fixed
            extra = spent(j, g) - spent(j, g_min)
            fair = (total + extra) / W
            if g_min == 1 and c <= fair:
                break  # splitting would not beat leaving it whole
            chosen = (g, extra)
            if m <= fair:
                break
        if chosen is not None and chosen[0] != g_min:
            widths[j] = chosen[0]
            total += chosen[1]
    return widths


def _balance_around(costs: list[float], base: list[float]) -> list[list[int]]:
    """Assign items to ``len(base)`` bins whose loads start at ``base``, evening out the loads: greedy LPT from the
    base loads, then the partitioner's exchange search (moves and swaps between the heaviest bin and the lightest
    ones) with the base loads held fixed. Deterministic (ties by index)."""
    k = len(base)
    heap = [(float(b), r) for r, b in enumerate(base)]
    heapq.heapify(heap)
    items: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        items[r].append(i)
        heapq.heappush(heap, (load + costs[i], r))
    exchange_search(items, costs, allow_moves=True, max_evals=2 * k + _MAX_EVALS_EXTRA, max_partners=_MAX_PARTNERS,
                  base=base)
    return [sorted(b) for b in items]
