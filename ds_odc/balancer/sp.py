"""``lb-mini-sp``: LB-Mini plus sequence parallelism for the samples that no single rank can take.

When one sample costs more than a rank's fair share of the minibatch (``total cost / W``), the rank holding it sets
the step time whatever the other ranks do. This planner gives such a sample to a *group* of ``g`` ranks that train
it together, each holding ``1/g`` of its tokens, and balances every other sample with LB-Mini around the groups'
work. A group has any size 2, 4, 8, ... up to the world size (:meth:`SplitPolicy.group_sizes`); inside attention it
is ``u`` Ulysses ranks (all-to-alls that trade sequence for heads, as far as the model's heads allow) times
``g / u`` ring ranks (keys and values exchanged across them), the shape whose exchange costs least
(:meth:`SplitPolicy.ulysses_size`), Ulysses kept inside a node.

Plan, deterministically and without communication (every rank computes the same one):

1. *Which samples split, and how wide.* Heaviest first, every candidate (a sample longer than ``max_tokens``, which
   must split so that each slice fits the microbatch budget, or one costing more than half the fair share) stays
   whole if the least loaded rank can take it within the fair share; otherwise it splits over the smallest group
   with which every member finishes within the fair share, counting what the ranks already hold (the split samples
   placed before it, and the heavier samples kept whole). The fair share grows with each split's overhead. When no
   choice fits, the one that finishes first.
2. *Where.* Groups are aligned blocks of ranks (``[k*g, (k+1)*g)``), so groups nest and a group of up to
   ``ranks_per_node`` ranks never spans two nodes: the block where the sample finishes first.
3. *When.* Every member trains its split samples first, in the plan's global order (:attr:`Plan.splits`): two
   ranks that share several split samples meet for them in the same order, so nobody waits on a peer that waits
   on someone else, and no group can deadlock.
4. *The rest.* The other samples are balanced over all ranks counting each rank's split work as already
   assigned (greedy LPT from those loads, then the partitioner's exchange search), and packed per rank as LB-Mini
   packs.
5. *Never worse than LB-Mini.* If LB-Mini's plan of the same samples, each trained whole, has a shorter step or a
   smaller bubble under the planning cost, that plan is returned instead (when every sample fits ``max_tokens``;
   a longer one cannot be trained whole). LB-Mini's plan is computed only when its lower bounds do not settle it.

With no sample worth splitting the plan is exactly LB-Mini's.

Cost of a split sample (per member): ``cost / (g * efficiency) + exchange + c``, where ``efficiency`` folds everything
that makes ``g`` ranks slower than ``1/g`` of one rank's time apart from the exchanged bytes (smaller matmuls,
imperfect overlap, the per-layer position gather), ``exchange`` is each member's traffic
(:meth:`SplitPolicy.exchange_per_member_token`: Ulysses' all-to-alls of q, k, v and the output, the ring's keys and
values), priced relative to the cost model's per-token term ``a`` (so it holds in any unit: tokens, FLOPs, seconds)
and ``inter_node_slowdown`` times more across nodes; ``c`` is the cost model's fixed cost of a microbatch, which
every member pays in full. 0.8 is the default efficiency until it is measured on several GPUs
(docs/SEQUENCE_PARALLEL.md says how).
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .cost import CostModel
from .packing import pack_positions
from .partitioner import exchange_search
from .plan import CheckedMinibatch, Plan, SplitSample, checked_minibatch, step_time
from .whole import assign_lb_mini

__all__ = ["SplitPolicy"]

DEFAULT_EFFICIENCY = 0.8
# Assumed H200 ratio of achieved bf16 training FLOP/s (~400 T) to all-to-all bytes/s per GPU inside one NVLink node
# (~150 G): what prices the exchange against compute. An estimate, not a measurement.
DEFAULT_FLOPS_PER_BYTE = 400e12 / 150e9
DEFAULT_INTER_NODE_SLOWDOWN = 4.0
_MAX_EVALS_EXTRA = 64
_MAX_PARTNERS = 16


@dataclass(frozen=True)
class SplitPolicy:
    """How samples may be split, and what a split sample costs each member.

    Attributes:
        efficiency: a split sample's compute on ``g`` ranks takes ``1 / (g * efficiency)`` of its time on one
            (``0 < efficiency <= 1``).
        ranks_per_node: ranks that share a fast interconnect (a node); a group's exchange over ranks of several
            nodes costs ``inter_node_slowdown`` times more per byte.
        max_group_size: the largest group (``None``: the world size). Groups have 2, 4, 8, ... ranks.
        max_ulysses_size: the most ranks of a group that share heads (``None``: as many as the heads allow); e.g. 1
            for ring attention alone.
        num_attention_heads, num_key_value_heads: the model's; Ulysses gives each of ``u`` members ``heads / u``
            query heads, so ``u`` must divide them, and either divide the KV heads or be a multiple of them (KV
            heads are then replicated, as DeepSpeed's ``UlyssesSPAttentionHF`` does). A group larger than the heads
            allow is ``u`` Ulysses ranks times ``g / u`` ring ranks. ``None``: no limit from the model.
        exchange_per_token: the all-to-all time of one token's q and attention-output tensors (all layers,
            forward and backward), as a multiple of that token's linear compute (the cost model's ``a``).
        exchange_per_kv_head: the same for k and v, per KV head (replicated heads count); also what the ring's
            exchange of keys and values costs per token and head.
        inter_node_slowdown: how many times longer a byte takes between nodes than inside one (default: 400 Gb/s
            per GPU between H200 nodes against ~150 GB/s of all-to-all inside one, rounded up; an estimate).
    """

    efficiency: float = DEFAULT_EFFICIENCY
    ranks_per_node: int = 8
    max_group_size: int | None = None
    max_ulysses_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    exchange_per_token: float = 0.0
    exchange_per_kv_head: float = 0.0
    inter_node_slowdown: float = DEFAULT_INTER_NODE_SLOWDOWN

    def __post_init__(self):
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"SplitPolicy.efficiency must be in (0, 1], got {self.efficiency}")
        if self.ranks_per_node < 1:
            raise ValueError(f"SplitPolicy.ranks_per_node must be >= 1, got {self.ranks_per_node}")
        for name in ("max_group_size", "max_ulysses_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"SplitPolicy.{name} must be >= 1 or None, got {getattr(self, name)}")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and heads < 1 or kv is not None and kv < 1:
            raise ValueError(f"SplitPolicy: head counts must be positive, got {heads} query / {kv} KV heads")
        if min(self.exchange_per_token, self.exchange_per_kv_head) < 0:
            raise ValueError("SplitPolicy: exchange costs must be non-negative")
        if self.inter_node_slowdown < 1:
            raise ValueError(f"SplitPolicy.inter_node_slowdown must be >= 1, got {self.inter_node_slowdown}")

    @classmethod
    def from_hf_config(cls, config: Any, *, efficiency: float = DEFAULT_EFFICIENCY, ranks_per_node: int = 8,
                       max_group_size: int | None = None, max_ulysses_size: int | None = None, dtype_bytes: int = 2,
                       flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE,
                       inter_node_slowdown: float = DEFAULT_INTER_NODE_SLOWDOWN) -> "SplitPolicy":
        """The policy of a Hugging Face decoder config (or a dict with its keys): head limits from the config, and
        the exchange of its q/k/v/output tensors at ``dtype_bytes`` per element, each byte costing as much time as
        ``flops_per_byte`` FLOPs of training compute (default: H200 estimate; ``0`` ignores the exchange)."""
        from .cost import QuadraticCost
        get = (lambda k: config.get(k)) if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
        missing = [k for k in ("num_attention_heads", "num_hidden_layers", "hidden_size") if get(k) is None]
        if missing:
            raise ValueError(f"the model config has no {', '.join(missing)}: SplitPolicy.from_hf_config needs a "
                             "decoder's attention shape; pass SplitPolicy(num_attention_heads=..., "
                             "num_key_value_heads=...) yourself")
        heads = int(get("num_attention_heads"))
        kv = int(get("num_key_value_heads") or heads)
        head_dim = int(get("head_dim") or int(get("hidden_size")) // heads)
        token_flops = QuadraticCost.from_hf_config(config).a  # a token's linear training compute
        per_element = 2 * int(get("num_hidden_layers")) * dtype_bytes * flops_per_byte / token_flops  # fwd + bwd
        return cls(efficiency=efficiency, ranks_per_node=ranks_per_node, max_group_size=max_group_size,
                   max_ulysses_size=max_ulysses_size, num_attention_heads=heads, num_key_value_heads=kv,
                   exchange_per_token=per_element * 2 * heads * head_dim,  # q and the attention output
                   exchange_per_kv_head=per_element * 2 * head_dim,  # k and v
                   inter_node_slowdown=inter_node_slowdown)

    def ulysses_limit(self, u: int) -> str | None:
        """Why the model's heads cannot be shared ``u`` ways by Ulysses (``None`` when they can)."""
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and heads % u:
            return f"{heads} query heads are not divisible by {u}"
        if kv is not None and kv % u and u % kv:
            return f"{kv} KV heads neither divide by {u} nor divide {u}"
        return None

    def group_sizes(self, world_size: int) -> tuple[int, ...]:
        """Allowed group sizes for ``world_size`` ranks, ascending: powers of two from 2 up to ``world_size`` and
        ``max_group_size``. Any model can be split into any of them: Ulysses as far as its heads allow, ring
        attention across that."""
        cap = min(int(world_size), self.max_group_size or int(world_size))
        sizes, g = [], 2
        while g <= cap:
            sizes.append(g)
            g *= 2
        return tuple(sizes)

    def ulysses_size(self, g: int) -> int:
        """How many of a group's ``g`` ranks share heads (Ulysses); the other factor, ``g / ulysses``, exchanges
        keys and values (ring). The cheapest exchange among the head counts the model allows, the larger Ulysses
        group on a tie (it needs no copy of the whole sample's keys and values)."""
        return _shape_of(self, int(g))[0]

    def crosses_nodes(self, span: int) -> bool:
        """Whether an aligned block of ``span`` ranks spans more than one node."""
        return span > self.ranks_per_node or self.ranks_per_node % span != 0

    def exchange_per_member_token(self, g: int, u: int) -> float:
        """A member's exchange when a sample of ``L`` tokens is split ``u`` (Ulysses) x ``g / u`` (ring) ways, per
        token of ``L``, in units of the cost model's ``a``: Ulysses sends ``(u - 1) / u`` of the q, k, v and output
        tensors of the member's ``L / g`` tokens; the ring brings in the keys and values of the other ``(r - 1) / r``
        of the sample for the member's ``max(kv, u) / u`` KV heads (and sends their gradients back)."""
        kv = self.num_key_value_heads or 0
        r = g // u
        ulysses = (1 / g) * ((u - 1) / u) * (self.exchange_per_token + self.exchange_per_kv_head * max(kv, u))
        ring = ((r - 1) / r) * self.exchange_per_kv_head * (max(kv, u) / u)
        slow = self.inter_node_slowdown
        return ulysses * (slow if self.crosses_nodes(u) else 1.0) + ring * (slow if self.crosses_nodes(g) else 1.0)

    def compute_share(self, g: int) -> float:
        """The fraction of a split sample's compute each of its ``g`` members spends: ``1 / (g * efficiency)``."""
        return 1.0 / (g * self.efficiency)

    def member_cost(self, cost: Any, length: Any, g: int, token_cost: float, ulysses: int | None = None) -> Any:
        """Per-member cost of a sample of ``length`` tokens whose own cost (``a*L + b*S``, without the microbatch's
        fixed cost) is ``cost``, split ``g`` ways (``ulysses`` x ``g / ulysses``; default: the cheapest shape);
        ``token_cost`` is the cost model's ``a`` (vectorised over numpy arrays)."""
        exchange = (_shape_of(self, int(g))[1] if ulysses is None
                    else self.exchange_per_member_token(int(g), int(ulysses)))
        return cost * self.compute_share(g) + length * token_cost * exchange


@functools.lru_cache(maxsize=4096)
def _shape_of(policy: SplitPolicy, g: int) -> tuple[int, float]:
    """(Ulysses size, exchange per member token) of the cheapest shape of a group of ``g``."""
    best = None
    u = 1
    while u <= min(g, policy.max_ulysses_size or g):
        if g % u == 0 and (u == 1 or policy.ulysses_limit(u) is None):
            cost = policy.exchange_per_member_token(g, u)
            if best is None or cost <= best[1]:
                best = (u, cost)
        u *= 2
    return best


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
        return float(self.policy.member_cost(cost, length, split.size, cost_model.a, split.ulysses))

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
    why = (f"so even split over the largest group, {max(sizes, default=1)} ranks (world size {world_size}"
           + (f", max_group_size {policy.max_group_size}" if policy.max_group_size else "")
           + f"), its slices exceed max_tokens={max_tokens}")
    m = checked_minibatch(lengths, W, max_tokens, cost, oversize, sq_lengths, limit, why)
    fixed = m.cost.per_microbatch
    common = dict(num_samples=int(m.active.size), num_tokens=int(m.lengths.sum()), planner=name,
                  max_tokens=max_tokens, truncated=m.truncated, skipped=m.skipped, split_limit=limit, policy=policy)
    act = m.active.tolist()

    def lb_mini() -> SplitPlan:  # every sample whole (one longer than max_tokens alone in its microbatch)
        base = assign_lb_mini(m.lengths.tolist(), m.costs.tolist(), fixed, W, max_tokens)
        return SplitPlan(microbatches=[[[act[j] for j in mb] for mb in rank] for rank in base], **common)

    chosen = _choose_splits(m, W, max_tokens, sizes, policy)
    if not chosen:  # nothing worth splitting: exactly LB-Mini (every sample fits max_tokens here)
        return lb_mini()
    fields, step, busy = _place(chosen, m, W, max_tokens, policy)
    return _no_worse_than_lb_mini(SplitPlan(**fields, **common), step, busy, lb_mini, m, lengths, sq_lengths,
                                  max_tokens)


def _place(chosen: list[tuple[int, int, int]], m: CheckedMinibatch, W: int, max_tokens: int | None,
           policy: SplitPolicy) -> dict:
    """Steps 3-4 of the module docstring: the split samples at the front of their members' lists, in order, then
    the other samples balanced around them. Returns the plan's ``microbatches`` and ``splits``, and its step time
    and total busy time under the planning cost."""
    cm, act, lens = m.cost, m.active.tolist(), m.lengths
    fixed, a = cm.per_microbatch, float(cm.a)
    len_of, cost_of = lens.tolist(), m.costs.tolist()  # Python numbers: far cheaper than numpy scalars one by one
    ready = [0.0] * W
    splits, members, first = [], [], [[] for _ in range(W)]
    for j, g, b in chosen:
        u = policy.ulysses_size(g)
        member = policy.member_cost(cost_of[j], len_of[j], g, a, u) + fixed
        lo, hi = b * g, (b + 1) * g
        ready[lo:hi] = [max(ready[lo:hi]) + member] * g
        splits.append(SplitSample(act[j], tuple(range(lo, hi)), u))
        members.append(member)
        for r in range(lo, hi):
            first[r].append([act[j]])

    split = {j for j, _, _ in chosen}
    rest = [j for j in range(len(act)) if j not in split]
    # As lb-mini counts them: a sample alone in its microbatch pays the fixed cost, a packed one its token share.
    if max_tokens is None:
        item = [cost_of[j] + fixed for j in rest]
    else:
        item = [cost_of[j] + fixed * len_of[j] / max_tokens for j in rest]
    shares = _balance_around(item, ready)
    microbatches, finish = [], []
    busy = math.fsum(len(s.ranks) * member for s, member in zip(splits, members))
    for r in range(W):
        mine = [rest[k] for k in shares[r]]
        local = pack_positions([len_of[j] for j in mine], [cost_of[j] for j in mine], max_tokens, None)
        microbatches.append(first[r] + [[act[mine[k]] for k in mb] for mb in local])
        own = math.fsum(cost_of[j] for j in mine) + fixed * len(local)
        busy += own
        finish.append(ready[r] + own)  # its split samples end at ready[r], waits for the groups included
    # The plan's step and busy time under the planning cost, as odc_schedule and microbatch_costs would give them.
    return dict(microbatches=microbatches, splits=tuple(splits)), max(finish, default=0.0), busy


def _no_worse_than_lb_mini(plan: SplitPlan, step: float, busy: float, lb_mini: Callable[[], SplitPlan],
                           m: CheckedMinibatch, lengths: Sequence[int], sq_lengths: Sequence[float] | None,
                           max_tokens: int | None) -> SplitPlan:
    """``plan`` (whose ``step`` and ``busy`` time are given), unless lb-mini's plan of the same samples, each trained
    whole, has a shorter step or a smaller bubble under the planning cost; then that plan, if every sample fits ``max_tokens`` (otherwise it cannot be
    trained, and ``plan`` stays). lb-mini's plan is only computed when its lower bounds do not already settle it:
    its step is at least ``max(costliest sample, least total work / W)``, and its busy time at most the samples'
    costs plus one fixed cost per sample."""
    W, cm, fixed = m.world_size, m.cost, m.cost.per_microbatch

    def step_and_bubble(p: SplitPlan) -> tuple[float, float]:
        mbc = p.microbatch_costs(cm, lengths, sq_lengths)
        t = step_time(mbc, "odc", p.splits)
        return t, 1.0 - math.fsum(map(math.fsum, mbc)) / (W * t) if t > 0 else 0.0

    bubble = 1.0 - busy / (W * step) if step > 0 else 0.0
    work = float(m.costs.sum())
    fewest = m.lengths.size if max_tokens is None else max(1, -(-int(m.lengths.sum()) // max_tokens))
    least_step = max(float(m.costs.max()) + fixed, (work + fixed * fewest) / W)
    least_bubble = 1.0 - (work + fixed * m.lengths.size) / (W * least_step)
    tol = 1e-9
    if step <= least_step * (1 + tol) and bubble <= least_bubble + tol:
        return plan
    whole = lb_mini()
    whole_step, whole_bubble = step_and_bubble(whole)
    if step <= whole_step * (1 + tol) and bubble <= whole_bubble + tol:
        return plan
    fits = max_tokens is None or int(m.lengths.max()) <= max_tokens
    return whole if fits else plan


def _choose_splits(m: CheckedMinibatch, W: int, max_tokens: int | None, sizes: tuple[int, ...],
                   policy: SplitPolicy) -> list[tuple[int, int, int]]:
    """Steps 1-2 of the module docstring: ``(position, group size, block)`` of every sample to split, in the
    order the groups run. Heaviest first, each candidate (a sample longer than ``max_tokens``, or costing more
    than half the fair share) is kept whole, or split over the smallest group with which every member finishes
    within the fair share, counting what the ranks already hold: split samples placed before it (a group starts
    when its last member is free) and heavier samples kept whole (on the least loaded rank). When no choice fits
    the fair share, the one that finishes soonest."""
    if not sizes or m.lengths.size == 0:
        return []
    fixed, a = m.cost.per_microbatch, float(m.cost.a)
    costs, lens = m.costs.tolist(), m.lengths.tolist()
    total = math.fsum(costs) + fixed * len(costs)  # grows by each split's overhead
    must = set() if max_tokens is None else set(np.flatnonzero(m.lengths > max_tokens).tolist())
    candidates = sorted((j for j in range(len(costs)) if j in must or (costs[j] + fixed) * W * 2 > total),
                        key=lambda j: (-costs[j], j))
    loads = _BlockLoads(W, sizes)
    chosen = []
    for j in candidates:
        c, L = costs[j] + fixed, lens[j]
        g_min = 1 if j not in must else next(g for g in sizes if -(-L // g) <= max_tokens)
        options = []  # (finish, group size, block or rank, overhead), the smallest group first
        if g_min == 1:
            r, free = loads.least_loaded_rank()
            options.append((free + c, 1, r, 0.0))
        for g in (g for g in sizes if g >= max(g_min, 2)):
            if options and options[-1][0] <= (total + options[-1][3]) / W:
                break  # the smaller choice already fits the fair share
            member = float(policy.member_cost(costs[j], L, g, a)) + fixed
            b, finish = loads.soonest_block(g, member)
            options.append((finish, g, b, g * member - c))
        last = options[-1]
        finish, g, where, extra = last if last[0] <= (total + last[3]) / W else min(options)
        if g == 1:
            loads.add_whole(where, c)
        else:
            loads.add_split(g, where, finish)
            total += extra
            chosen.append((j, g, where))
    return chosen


class _BlockLoads:
    """Per rank, when its split samples end and the heavy whole samples it holds; and per aligned block of every
    group size, the largest of each over its ranks (both only grow, so a block's maximum updates in place)."""

    def __init__(self, W: int, sizes: tuple[int, ...]):
        self.split_end, self.whole = np.zeros(W), np.zeros(W)
        self.sizes = sizes
        self.end_max = {g: np.zeros(W // g) for g in sizes}
        self.whole_max = {g: np.zeros(W // g) for g in sizes}

    def least_loaded_rank(self) -> tuple[int, float]:
        load = self.split_end + self.whole
        r = int(np.argmin(load))
        return r, float(load[r])

    def soonest_block(self, g: int, member: float) -> tuple[int, float]:
        """The block of ``g`` ranks where a split costing each member ``member`` finishes first, and when: it
        starts when the block's last split sample ends, and its members then still train their whole samples."""
        finish = self.end_max[g] + self.whole_max[g]
        b = int(np.argmin(finish))
        return b, float(finish[b]) + member

    def add_whole(self, r: int, cost: float) -> None:
        self.whole[r] += cost
        for g in self.sizes:
            mx = self.whole_max[g]
            if r // g < mx.size:  # ranks past the last whole block belong to no group of g
                mx[r // g] = max(mx[r // g], self.whole[r])

    def add_split(self, g: int, b: int, finish: float) -> None:
        lo, hi = b * g, (b + 1) * g
        end = finish - float(self.whole[lo:hi].max())  # the split sample ends here on every member
        self.split_end[lo:hi] = end
        for h in self.sizes:
            if h <= g:
                self.end_max[h][lo // h:hi // h] = end
            elif lo // h < self.end_max[h].size:
                mx = self.end_max[h]
                mx[lo // h] = max(mx[lo // h], end)


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
