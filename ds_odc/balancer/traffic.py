"""Traffic between nodes and model-state memory per GPU, for the ways a ZeRO-3 job can shard its model.

Pure arithmetic from the parameter count P, N nodes of G GPUs (W = N*G ranks) and the microbatches each rank runs
in a step. Four schemes:

``zero3``
    Stock ZeRO-3 over all W ranks. Per microbatch, every rank all-gathers every parameter twice (forward and
    backward) and reduce-scatters every gradient once, in lockstep. Across nodes these run as rings (what NCCL does),
    in which each byte of a remote shard enters a node once: per collective, (N-1)/N * P * bytes cross out of, and
    into, each node.
``odc``
    Flat ODC over all W ranks: the same reads and pushes per microbatch, but one-sided: every GPU reads the remote
    (N-1)/N of each parameter for itself, and pushes its own remote gradient slices, so a node's NIC carries G times
    a ring's bytes per microbatch of each of its ranks (the paper's inter-node ODC penalty).
``mics``
    Shards inside a node, replicas across nodes, collectives (MiCS, as DeepSpeed had it before 0.19.8): gathers and
    reduce-scatters stay in the node; once per step the accumulated gradient shards are all-reduced across the N
    replicas (a ring: 2 (N-1)/N * P * accumulation bytes per node).
``hybrid``
    ODC with ``odc.shard_size`` = G: reads and pushes stay in the node (NVLink); the same once-per-step all-reduce
    as MiCS, whatever the microbatch counts and lengths.

Bytes are one direction (what leaves a node; the same amount enters it). Memory counts the model state only
(parameters, fp32 master copy, gradient accumulator, Adam's two moments) held per GPU: 1/W of it with flat
sharding, 1/G with a node per shard group; activations and the gathered layers in flight are the same for all four.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["SCHEMES", "Precision", "parameter_count", "allreduce_bytes_per_node", "internode_bytes_per_node",
           "state_bytes_per_gpu", "InterNode"]

SCHEMES = ("zero3", "odc", "mics", "hybrid")
SHARDED_BY_NODE = {"mics", "hybrid"}


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what moves and what is kept (defaults: bf16 training with fp32 master and Adam)."""

    param: int = 2  # gathered parameters (bf16)
    grad: int = 2  # pushed or reduce-scattered gradients (bf16)
    accumulator: int = 4  # accumulated gradient shards and the step's all-reduce (fp32)
    master: int = 4  # fp32 master weights
    optimizer: int = 8  # Adam's two fp32 moments

    @property
    def state(self) -> int:
        """Model-state bytes per parameter, however sharded."""
        return self.param + self.accumulator + self.master + self.optimizer


def _get(config: Any, key: str):
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def parameter_count(config: Any) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its config (a dict or config object): embedding, LM head
    unless tied, per layer q/k/v/o (with q/k/v biases for ``model_type`` "qwen2", or when ``attention_bias`` is
    true), the gated MLP and two norms, and the final norm."""
    h, i, layers = int(_get(config, "hidden_size")), int(_get(config, "intermediate_size")), \
        int(_get(config, "num_hidden_layers"))
    heads = int(_get(config, "num_attention_heads"))
    kv_heads = int(_get(config, "num_key_value_heads") or heads)
    head_dim = int(_get(config, "head_dim") or h // heads)
    vocab = int(_get(config, "vocab_size") or 0)
    q, kv = heads * head_dim, kv_heads * head_dim
    has_bias = bool(_get(config, "attention_bias")) or _get(config, "model_type") == "qwen2"
    qkv_bias = q + 2 * kv if has_bias else 0
    per_layer = h * q + 2 * h * kv + q * h + qkv_bias + 3 * h * i + 2 * h
    tied = _get(config, "tie_word_embeddings")
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def _check(scheme: str, nodes: int, gpus_per_node: int) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {SCHEMES}")
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("nodes and gpus_per_node must be positive")


def allreduce_bytes_per_node(params: int, nodes: int, precision: Precision = Precision()) -> float:
    """One ring all-reduce of the model's accumulated gradient across nodes, per node."""
    return 2.0 * (nodes - 1) / nodes * params * precision.accumulator


def internode_bytes_per_node(scheme: str, params: int, nodes: int, gpus_per_node: int,
                             microbatches_per_rank: float, precision: Precision = Precision()) -> float:
    """Bytes leaving one node per optimizer step. ``microbatches_per_rank``: the mean over the node's ranks (under
    collectives every rank runs the same number, the plan's slot count)."""
    _check(scheme, nodes, gpus_per_node)
    remote = (nodes - 1) / nodes
    per_collective_round = remote * params * (2 * precision.param + precision.grad)  # 2 gathers + 1 reduction
    if scheme == "zero3":
        return microbatches_per_rank * per_collective_round
    if scheme == "odc":
        return gpus_per_node * microbatches_per_rank * per_collective_round
    return allreduce_bytes_per_node(params, nodes, precision)


def state_bytes_per_gpu(scheme: str, params: int, nodes: int, gpus_per_node: int,
                        precision: Precision = Precision()) -> float:
    """Model-state bytes one GPU holds (see the module docstring)."""
    _check(scheme, nodes, gpus_per_node)
    shards = gpus_per_node if scheme in SHARDED_BY_NODE else nodes * gpus_per_node
    return params * precision.state / shards


@dataclass(frozen=True)
class InterNode:
    """The inter-node term of the simulator's step time, in seconds: ``ranks`` GPUs, ``gpus_per_node`` to a node,
    each node's NIC moving ``bandwidth`` bytes/s each way, the model sharded flat (``sharding="flat"``: stock ZeRO-3
    under collectives, flat ODC under ODC) or one shard group per node (``"node"``: MiCS-style under collectives,
    hybrid ODC under ODC). The time is not overlapped with compute (an upper bound on what it costs); traffic inside
    a node is not modelled."""

    params: int
    ranks: int
    gpus_per_node: int
    bandwidth: float
    sharding: str = "flat"
    precision: Precision = Precision()

    def __post_init__(self):
        if self.sharding not in ("flat", "node"):
            raise ValueError(f"unknown sharding {self.sharding!r}; use 'flat' or 'node'")
        if self.ranks % self.gpus_per_node:
            raise ValueError(f"{self.ranks} ranks do not fill nodes of {self.gpus_per_node} GPUs")
        if self.bandwidth <= 0:
            raise ValueError("the inter-node bandwidth must be positive")

    @property
    def nodes(self) -> int:
        return self.ranks // self.gpus_per_node

    def scheme(self, sync: str) -> str:
        odc = sync.startswith("odc")
        if self.sharding == "node":
            return "hybrid" if odc else "mics"
        return "odc" if odc else "zero3"

    def per_microbatch(self, sync: str) -> float:
        """Seconds a rank spends moving one microbatch's reads and pushes across nodes (its fair share of the NIC)."""
        scheme = self.scheme(sync)
        if scheme in SHARDED_BY_NODE:
            return 0.0
        # Collectives: the node's ranks move one microbatch's bytes together, at the NIC's full rate. ODC: each rank
        # moves its own, G times a ring's, at 1/G of the NIC while its node's ranks all read; the same time.
        node_bytes = internode_bytes_per_node(scheme, self.params, self.nodes, self.gpus_per_node, 1.0,
                                              self.precision)
        return node_bytes / self.bandwidth

    def per_step(self, sync: str) -> float:
        """Seconds of the step's cross-node all-reduce (node-sharded schemes only)."""
        if self.scheme(sync) not in SHARDED_BY_NODE:
            return 0.0
        return allreduce_bytes_per_node(self.params, self.nodes, self.precision) / self.bandwidth
