"""Migration plans: the ordered expert copies that turn the serving placement into a new one.

Both placements must be aligned (GPU g is the same GPU in both, and an expert a GPU keeps stays in its
slot; see :mod:`solvers.migration`). Every slot whose expert changes is written once:

* a **copy** when its GPU did not hold that expert in the serving placement: the weights come from a
  GPU that does: with nodes, one on the destination's node whenever there is one (NVLink, not the NIC),
  else one whose replica stays put when there is one; among those, replicas that stay put first, reads
  spread over the holders in turn;
* a **local** write when the GPU already holds the expert in another slot (no transfer between GPUs;
  only placements with two replicas of one expert on one GPU need it);
* a **release** (expert -1, local, no bytes) when the new placement leaves the slot empty (-1): nothing
  is copied, and the slot's old replica can still be read until its layer's last copy. An empty slot of
  the serving placement is never read; filling it is a copy (or a local write) like any other.

Copies are grouped in **stages** of at most ``stage_bytes`` each. A stage is applied as a unit: read
every source, write every destination, then the stage's local writes and releases. A copy never reads a
slot that an earlier stage overwrote: when every holder of the expert is overwritten, the copy goes in the
same stage as the overwrite or an earlier one, and copies that read each other's slots (a cycle) share one
stage. So every expert keeps a replica after every stage, the cluster can serve between stages, and
applying the stages in order to the serving placement gives the new one.

Every copy reads a replica of the serving placement, never one that an earlier copy landed: two GPUs of
one node that both receive an expert the node does not hold both read it across the NIC. Reading the
second from the first once it has landed would save NIC bytes, but is not done: the second copy would have
to come in a later stage than the first (a copy is readable only after its stage), so a layer's copies
would no longer go out in one stage (without a budget) and the cluster would wait for a chain of stages;
and the transfer estimate (`eplb.cost.migration`: every GPU's copies at once, the busiest GPU's bytes set
the time) gains only where the busiest GPU's NIC bytes are such second copies.

Shapes: ``phy2log [L, P]`` (-1: an empty slot), ``slots_per_gpu [G]``; a plan holds one row per write,
arrays ``[N]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from solvers.validation import EMPTY_SLOT, replica_counts

IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

__all__ = ["MigrationPlan", "PlanError", "apply_plan", "build_plan"]


class PlanError(ValueError):
    """A plan that cannot be built as asked (shapes, alignment, or a stage budget below a cycle)."""


@dataclass(frozen=True)
class MigrationPlan:
    """One row per slot write, in application order: layer (row of phy2log), expert (-1: a release, the
    slot left empty), source GPU and slot (in the serving placement; the destination GPU for a local write,
    the slot itself for a release), destination GPU and slot, local (no transfer), stage (0, 1, ...).
    bytes_per_copy: one expert in one layer, bytes (None when unknown); stage_bytes: the budget of one stage
    (None: one stage per layer)."""

    layer: IntArray
    expert: IntArray
    src_gpu: IntArray
    src_slot: IntArray
    dst_gpu: IntArray
    dst_slot: IntArray
    local: BoolArray
    stage: IntArray
    bytes_per_copy: float | None = None
    stage_bytes: float | None = None

    @property
    def num_copies(self) -> int:
        """Expert weights landing on a GPU that did not hold them (local writes excluded)."""
        return int((~self.local).sum())

    @property
    def num_stages(self) -> int:
        return int(self.stage.max()) + 1 if self.stage.size else 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; docs/formats.md, "Migration plans"."""
        per = self.bytes_per_copy
        stages: list[dict[str, Any]] = []
        columns = [a.tolist() for a in (self.layer, self.expert, self.src_gpu, self.src_slot, self.dst_gpu,
                                        self.dst_slot, self.local, self.stage)]
        for layer, expert, sg, ss, dg, ds, local, stage in zip(*columns, strict=True):
            while len(stages) <= stage:
                stages.append({"bytes": 0.0 if per is not None else None, "copies": []})
            stages[stage]["copies"].append({
                "layer": layer, "expert": expert, "src_gpu": sg, "src_slot": ss, "dst_gpu": dg, "dst_slot": ds,
                "bytes": None if per is None else (0.0 if local else per),
            })
            if per is not None and not local:
                stages[stage]["bytes"] += per
        return {
            "num_copies": self.num_copies,
            "bytes_per_copy": per,
            "total_bytes": None if per is None else self.num_copies * per,
            "stage_bytes": self.stage_bytes,
            "stages": stages,
        }


def _occurrence(key: IntArray) -> IntArray:
    """For each entry of ``key [N]``, how many equal keys come before it."""
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    first = np.flatnonzero(np.concatenate([[True], sorted_key[1:] != sorted_key[:-1]]))
    occ = np.empty_like(key)
    occ[order] = np.arange(key.size) - np.repeat(first, np.diff(np.append(first, key.size)))
    return occ


def _chains(before: IntArray) -> tuple[IntArray, IntArray]:
    """before [n]: the copy each copy must not come after (-1: none); one out-edge per node, so chains
    end in a sink or a cycle. Returns (group [n]: a cycle's smallest member for nodes on a cycle, the
    node itself otherwise; depth [n]: steps to the chain's end, so sorting by depth descending puts every
    node before the one it points to). Pointer doubling, log2(n) numpy steps."""
    n = before.size
    f = np.where(before >= 0, before, np.arange(n))
    rounds = max(1, int(np.ceil(np.log2(max(n, 2)))) + 1)
    jump, low, depth = f.copy(), np.arange(n), np.zeros(n, dtype=np.int64)
    for _ in range(rounds):
        jump = jump[jump]
    on_cycle = np.zeros(n, dtype=bool)
    on_cycle[jump] = True  # the image of f^(2^rounds): exactly the nodes on cycles (sinks loop on themselves)
    jump, steps = f.copy(), (~on_cycle).astype(np.int64)
    for _ in range(rounds):
        low = np.minimum(low, low[jump])
        steps = steps + steps[jump]
        jump = jump[jump]
    depth = steps
    group = np.where(on_cycle, low, np.arange(n))
    return group, depth


def build_plan(
    current_phy2log: ArrayLike,
    new_phy2log: ArrayLike,
    slots_per_gpu: ArrayLike,
    bytes_per_copy: float | None = None,
    stage_bytes: float | None = None,
    gpus_per_node: int | None = None,
) -> MigrationPlan:
    """The plan from ``current_phy2log [L, P]`` to the aligned ``new_phy2log [L, P]`` (same
    ``slots_per_gpu [G]``; -1: an empty slot). bytes_per_copy: one expert's weights in one layer, bytes;
    stage_bytes: most bytes copied per stage (needs bytes_per_copy); None gives each layer with copies a stage.
    gpus_per_node: a copy reads a source on its destination's node when there is one (NVLink, not the NIC),
    even one whose slot is overwritten (the copy then comes no later than the overwrite), except where that
    would tie copies into a cycle longer than the stage budget and a replica that stays put elsewhere breaks
    it (that copy then reads across the NIC)."""
    cur = np.asarray(current_phy2log, dtype=np.int64)
    new = np.asarray(new_phy2log, dtype=np.int64)
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    if cur.ndim != 2 or cur.shape != new.shape or int(slots.sum()) != cur.shape[1]:
        raise PlanError(
            f"current {cur.shape} and new {new.shape} placements must both be [layers, {int(slots.sum())} slots]"
        )
    if cur.size and min(int(cur.min()), int(new.min())) < EMPTY_SLOT:
        raise PlanError(f"placement entries must be expert ids >= 0 or {EMPTY_SLOT} (an empty slot), got "
                        f"{min(int(cur.min()), int(new.min()))}")
    budget = None
    if stage_bytes is not None:
        if bytes_per_copy is None:
            raise PlanError("a stage byte budget needs the bytes of one expert copy (give the model)")
        if not math.isfinite(stage_bytes):
            raise PlanError(f"a stage byte budget must be a finite number of bytes, got {stage_bytes}")
        if not stage_bytes >= bytes_per_copy:
            raise PlanError(f"a stage of {stage_bytes:.4g} bytes cannot hold one expert copy "
                            f"({bytes_per_copy:.4g} bytes)")
        budget = int(stage_bytes // bytes_per_copy)
    num_layers, num_physical = cur.shape
    num_experts = int(max(cur.max(initial=0), new.max(initial=0))) + 1
    gpu = np.repeat(np.arange(slots.size), slots)
    layer_all = np.repeat(np.arange(num_layers), num_physical)
    gpu_all = np.tile(gpu, num_layers)
    cur_flat, new_flat = cur.ravel(), new.ravel()
    occupied = cur_flat != EMPTY_SLOT  # an empty slot of the serving placement holds nothing to read
    holds = np.zeros((num_layers, slots.size, num_experts), dtype=bool)
    holds[layer_all[occupied], gpu_all[occupied], cur_flat[occupied]] = True
    overwritten = (cur_flat != new_flat) & (new_flat != EMPTY_SLOT)  # written by the plan; a released slot is not
    changed = np.flatnonzero(overwritten)
    released = np.flatnonzero((cur_flat != new_flat) & (new_flat == EMPTY_SLOT))
    c_layer, c_slot, c_expert = layer_all[changed], changed % num_physical, new_flat[changed]
    c_gpu = gpu[c_slot]
    key = (c_layer * slots.size + c_gpu) * num_experts + c_expert
    held = holds[c_layer, c_gpu, c_expert]
    local = held | (_occurrence(key) > 0)  # already on the GPU, or a second replica landing on it
    remote = np.flatnonzero(~local)
    # sources: the expert's holders in the serving placement; those on the destination's node first (replicas
    # that stay put first among them, else the node's others), else replicas that stay put anywhere (else
    # all); in turn within each choice. Empty slots get key -1, which no copy asks for.
    holder_key = np.where(occupied, layer_all * num_experts + cur_flat, -1)
    stays = occupied & ~overwritten
    node = gpu // (gpus_per_node or slots.size)
    nodes = int(node.max(initial=0)) + 1
    holder_node = np.tile(node, num_layers)
    flat_index = np.arange(holder_key.size)
    want = c_layer[remote] * num_experts + c_expert[remote]
    # on the destination's node: holders sorted by (layer and expert, node, overwritten, slot)
    node_key = np.where(occupied, holder_key * nodes + holder_node, -1)
    near_order = np.lexsort((flat_index, overwritten, holder_node, holder_key))
    want_near = want * nodes + node[c_slot[remote]]
    near_first = np.searchsorted(node_key[near_order], want_near)
    near = np.searchsorted(node_key[near_order], want_near, side="right") - near_first
    near_stable = np.bincount(node_key[stays], minlength=num_layers * num_experts * nodes)[want_near]
    near_block = np.where(near_stable > 0, near_stable, near)
    src_near = near_order[np.where(near > 0, near_first + _occurrence(want_near) % np.maximum(near_block, 1), 0)]
    # anywhere: holders sorted by (layer and expert, overwritten, slot)
    far_order = np.lexsort((flat_index, overwritten, holder_key))
    first = np.searchsorted(holder_key[far_order], want)
    n_all = np.searchsorted(holder_key[far_order], want, side="right") - first
    if not n_all.all():
        i = remote[int(np.argmin(n_all))]
        raise PlanError(f"layer {int(c_layer[i])}: expert {int(c_expert[i])} is in no slot of the serving placement, "
                        f"so its copy onto GPU {int(c_gpu[i])} has nothing to read; give the placement serving now")
    stable = np.bincount(holder_key[stays], minlength=num_layers * num_experts)[want]
    block = np.where(stable > 0, stable, n_all)
    src_far = far_order[first + _occurrence(want) % block]
    use_near = near > 0
    # a copy must not come after the copy that overwrites its source slot; copies reading each other's slots
    # (a cycle) share a stage, so a cycle longer than the stage budget gives up a node-local source that is
    # overwritten for a replica that stays put elsewhere, one copy per cycle at a time, while one has it
    writer = np.full(num_layers * num_physical, -1, dtype=np.int64)
    writer[changed[remote]] = np.arange(remote.size)
    while True:
        src_flat = np.where(use_near, src_near, src_far)
        group, depth = _chains(writer[src_flat])
        if budget is None:
            break
        too_long = np.bincount(group, minlength=remote.size)[group] > budget
        switch = np.flatnonzero(too_long & use_near & (stable > 0))
        if switch.size == 0:
            break
        use_near[switch[np.unique(group[switch], return_index=True)[1]]] = False
    src_slot = src_flat % num_physical
    sequence = np.lexsort((c_slot[remote], group, -depth, c_layer[remote]))
    r_layer, r_group = c_layer[remote][sequence], group[sequence]
    # units: runs of one cycle; stages: units packed in order, within the budget or one layer each
    boundary = np.concatenate([[True], (r_group[1:] != r_group[:-1]) | (r_layer[1:] != r_layer[:-1])])
    starts = np.flatnonzero(boundary[: remote.size])
    sizes = np.diff(np.append(starts, remote.size))
    stage_of_unit = np.zeros(starts.size, dtype=np.int64)
    stage, filled, last_layer = -1, 0, -1
    for u, (at, size) in enumerate(zip(starts.tolist(), sizes.tolist(), strict=True)):
        layer = int(r_layer[at])
        if budget is not None and size > budget:
            assert bytes_per_copy is not None
            raise PlanError(
                f"layer {layer}: {size} copies read each other's slots and must move in one stage; raise the "
                f"stage budget to at least {size * bytes_per_copy / 2**30:.3g} GiB"
            )
        if stage < 0 or (filled + size > budget if budget is not None else layer != last_layer):
            stage, filled = stage + 1, 0
        stage_of_unit[u], filled, last_layer = stage, filled + size, layer
    r_stage = np.repeat(stage_of_unit, sizes)
    # local writes read a slot of their GPU that holds the expert in the new placement and is not itself
    # a local destination; they and the releases join the stage of their layer's last copy (or a stage after all)
    lo = np.flatnonzero(local)
    final = new_flat != EMPTY_SLOT
    final[changed[lo]] = False
    final_idx = np.flatnonzero(final)
    final_key = (layer_all[final_idx] * slots.size + gpu_all[final_idx]) * num_experts + new_flat[final_idx]
    key_order = np.argsort(final_key, kind="stable")
    pos = np.searchsorted(final_key[key_order], key[lo]).clip(max=max(final_key.size - 1, 0))
    found = final_key[key_order[pos]] == key[lo] if final_key.size else np.zeros(lo.size, dtype=bool)
    if not found.all():
        layer = int(c_layer[lo][~found][0])
        raise PlanError(f"layer {layer}: the new placement moves experts between slots of one GPU; align it with "
                        "the serving placement first (solvers.migration.relabel_gpus or arrange_slots)")
    lo_src = final_idx[key_order[pos]] % num_physical
    last_stage = np.full(num_layers, -1, dtype=np.int64)
    np.maximum.at(last_stage, r_layer, r_stage)
    after_all = r_stage.max(initial=-1) + 1
    lo_stage, rel_stage = (np.where(s >= 0, s, after_all) for s in (last_stage[c_layer[lo]],
                                                                    last_stage[layer_all[released]]))
    rows_remote = remote[sequence]
    rel_slot = released % num_physical
    layers = np.concatenate([c_layer[rows_remote], c_layer[lo], layer_all[released]])
    experts = np.concatenate([c_expert[rows_remote], c_expert[lo], np.full(released.size, EMPTY_SLOT)])
    src = np.concatenate([src_slot[sequence], lo_src, rel_slot])
    dst = np.concatenate([c_slot[rows_remote], c_slot[lo], rel_slot])
    stages = np.concatenate([r_stage, lo_stage, rel_stage])
    is_local = np.concatenate([np.zeros(rows_remote.size, dtype=bool), np.ones(lo.size + released.size, dtype=bool)])
    order = np.lexsort((is_local, stages))
    return MigrationPlan(
        layer=layers[order],
        expert=experts[order],
        src_gpu=gpu[src[order]],
        src_slot=src[order],
        dst_gpu=gpu[dst[order]],
        dst_slot=dst[order],
        local=is_local[order],
        stage=stages[order],
        bytes_per_copy=bytes_per_copy,
        stage_bytes=stage_bytes,
    )


def apply_plan(current_phy2log: ArrayLike, plan: MigrationPlan) -> IntArray:
    """Apply ``plan`` stage by stage to ``current_phy2log [L, P]`` (-1: an empty slot); returns the result
    ``[L, P]``. Raises PlanError when a write reads a slot that does not hold its expert (a release, expert
    -1, reads nothing), or when an expert of the serving placement has no replica in some layer after a stage
    (the cluster could not serve between stages)."""
    state = np.array(current_phy2log, dtype=np.int64, copy=True)
    num_experts = int(max(state.max(initial=0), plan.expert.max(initial=0))) + 1
    served = replica_counts(state, num_experts) > 0  # [L, E] the experts that must keep a replica
    for k in range(plan.num_stages):
        in_stage = plan.stage == k
        for local in (False, True):  # copies read before any write of the stage; local writes after them
            rows = np.flatnonzero(in_stage & (plan.local == local))
            reads = plan.expert[rows] != EMPTY_SLOT
            bad = reads & (state[plan.layer[rows], plan.src_slot[rows]] != plan.expert[rows])
            if bad.any():
                i = rows[np.argmax(bad)]
                raise PlanError(f"stage {k}: expert {plan.expert[i]} of layer {plan.layer[i]} is read from slot "
                                f"{plan.src_slot[i]}, which holds {state[plan.layer[i], plan.src_slot[i]]}")
            state[plan.layer[rows], plan.dst_slot[rows]] = plan.expert[rows]
        lost = served & (replica_counts(state, num_experts) == 0)
        if lost.any():
            layer, expert = (int(v) for v in np.argwhere(lost)[0])
            raise PlanError(f"after stage {k}, expert {expert} of layer {layer} has no replica")
    return state
