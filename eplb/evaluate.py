"""How balanced a placement is on a load window: GPU loads and the three balance numbers users quote."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from eplb.budget import spread_evenly
from eplb.errors import EplbError
from eplb.io.files import real_array
from eplb.placement import Placement, expert_count


@dataclass(frozen=True)
class Balance:
    """gpu_loads: [layers, G] tokens; lb = max/mean, balancedness = mean/max (vLLM, SGLang),
    imbalance = (max - mean)/mean (TensorRT-LLM): each [layers]. A layer with no tokens has no lb (docs/replay.md):
    the arrays hold 1 there (so the solvers' arithmetic stays finite), `has_tokens` marks the layers that have one,
    and every report leaves the others out (`lb_over_tokens`; the API's per-layer lists say null)."""

    gpu_loads: NDArray[np.float64]
    lb: NDArray[np.float64]
    balancedness: NDArray[np.float64]
    imbalance: NDArray[np.float64]

    @property
    def has_tokens(self) -> NDArray[np.bool_]:
        """[layers] whether the layer routes any token (the others have no lb)."""
        out: NDArray[np.bool_] = self.gpu_loads.sum(axis=1) > 0
        return out

    def lb_over_tokens(self) -> tuple[float, float] | None:
        """(mean, max) lb over the layers with tokens; None when no layer has any."""
        lb = self.lb[self.has_tokens]
        return None if lb.size == 0 else (float(lb.mean()), float(lb.max()))


def placement_loads(loads: ArrayLike, placement: Placement) -> NDArray[np.float64]:
    """loads (numbers or a tensor: `real_array`) as float64 [layers, E] when they are the placement's layers and
    experts; EplbError saying both shapes otherwise (numpy would broadcast one layer over all, or drop experts the
    placement does not hold)."""
    array = real_array(loads, "loads", "loads must hold only numbers")
    if array.shape != (placement.num_layers, placement.num_experts):
        raise EplbError(f"the placement is for {placement.num_layers} layers x {placement.num_experts} experts, the "
                        f"loads are {' x '.join(map(str, array.shape)) or 'one number'}")
    return array


def gpu_loads(loads: ArrayLike, placement: Placement) -> NDArray[np.float64]:
    """Tokens each GPU serves: [layers, G], from loads [layers, E] (the placement's: `placement_loads`) and the
    slots' shares."""
    loads = placement_loads(loads, placement)
    slot_load = np.take_along_axis(loads, placement.phy2log, axis=1) * placement.slot_shares()
    starts = np.concatenate([[0], np.cumsum(placement.slots_per_gpu)[:-1]])
    return np.add.reduceat(slot_load, starts, axis=1)


def balance(loads: ArrayLike, placement: Placement) -> Balance:
    """Balance of a placement on loads [layers, E] (same layer count and E as the placement: `placement_loads`)."""
    per_gpu = gpu_loads(loads, placement)
    mean = per_gpu.mean(axis=1)
    peak = per_gpu.max(axis=1)
    empty = mean <= 0
    lb = np.where(empty, 1.0, peak / np.where(empty, 1.0, mean))
    return Balance(per_gpu, lb, 1.0 / lb, lb - 1.0)


def contiguous_placement(num_layers: int, num_experts: int, num_gpus: int) -> Placement:
    """The no-EPLB baseline: experts in id order, E/G consecutive ids per GPU, no redundancy.

    With more GPUs than experts (DeepSeek-V3's EP320 decode: 256 experts, one per GPU) every GPU gets one
    slot and the extra GPUs hold experts 0, 1, ... again in id order (vLLM's initial placement): the
    load-unaware placement such a cluster serves without EPLB.
    """
    num_gpus = expert_count(num_gpus, "contiguous_placement: num_gpus")  # the rule for a count >= 1, not only E's
    num_experts = expert_count(num_experts, "contiguous_placement: num_experts")
    if num_gpus > num_experts:
        slots = np.ones(num_gpus, dtype=np.int64)
        phy2log = np.arange(num_gpus, dtype=np.int64) % num_experts
        return Placement(np.broadcast_to(phy2log, (num_layers, num_gpus)).copy(), slots, num_experts)
    slots = spread_evenly(num_experts, num_gpus)
    phy2log = np.broadcast_to(np.arange(num_experts, dtype=np.int64), (num_layers, num_experts))
    return Placement(phy2log.copy(), slots, num_experts)
