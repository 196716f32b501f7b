"""vLLM EPLB policy plug-in: eplb's placement behind vLLM's `rebalance_experts` interface.

vLLM keeps its EPLB algorithms in a policy table (`vllm.distributed.eplb.policy.EPLB_POLICIES`, name ->
class with the class method `rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks,
old_global_expert_indices=None)`) and looks the configured name up when EPLB starts. `register()` is
the `vllm.general_plugins` entry point: it adds `EplbPolicy` to that table as "eplb" without editing
vLLM's files, and with `EPLB_VLLM_POLICY=eplb` also puts it under "default" (what `eplb_config.policy`
selects unless set).

Return convention: older vLLM policies return `(phy2log, log2phy, logcnt)`, newer ones `phy2log` alone
(vLLM derives the rest). `detect_convention` reads it from the installed vLLM's abstract policy;
`policy_class(convention)` gives a class for either when vLLM is absent. vLLM's sources after 0.33.0 (the newest
release, which calls the class method) make the policy an instance whose abstract `plan_rebalance(context,
policy_state)` answers an `EplbPlan`; the class has that method too, computed as `rebalance_experts` is.

torch is imported lazily (inside the calls), so importing this module needs neither torch nor vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import types
from typing import Any, ClassVar, Literal

import numpy as np

from eplb.integrations import core

Convention = Literal["phy2log", "tuple"]
POLICY_NAME = core.SELECTED
SELECT_ENV = core.VLLM_SELECT
NAMES = core.Arguments(old="old_global_expert_indices")
"""vLLM's names of the policy's arguments (`rebalance_experts`), which the plug-in's errors use."""
PLAN_NAMES = core.Arguments(
    weight="context.load_window_cpu", num_replicas="context.num_replicas", num_groups="context.topology.num_groups",
    num_nodes="context.topology.num_nodes", num_ranks="context.topology.num_ranks",
    old="context.physical_to_logical_map_cpu", windows=True)
"""The same for `plan_rebalance`: the fields of vLLM's `EplbRebalanceContext`; its window is [samples, L, E]."""
POLICY_MODULE = "vllm.distributed.eplb.policy"

# A child of vLLM's logger, so lines appear in vLLM's log with its format and level.
logger = logging.getLogger("vllm.eplb_plugin")


class EplbPolicy:
    """vLLM EPLB policy that solves with eplb (locally or through the service, see `core.rebalance`).

    Without `old_global_expert_indices` the answer equals DeepSeek EPLB's (vLLM's default algorithm) for
    the default EPLB_SOLVER=deepseek (in remote mode the map this plug-in answered last stands in for them:
    `core.remote`). With them (the map now serving, [L, P], -1 for unused slots), at most
    EPLB_MAX_MOVES expert copies are spent and every expert that stays on a GPU keeps its slot.
    """

    convention: ClassVar[Convention] = "phy2log"

    @classmethod
    def rebalance_experts(
        cls,
        weight: Any,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_global_expert_indices: Any = None,
    ) -> Any:
        """weight: [L, E] tokens per logical expert (any device, any numeric dtype; or a numpy array, lists);
        old_global_expert_indices: [L, P] the map now serving, -1 for unused slots (the same kinds); the counts are
        ints. Returns int64 CPU tensors: phy2log [L, num_replicas], and for the tuple convention also log2phy
        [L, E, X] (-1 padded) and logcnt [L, E]. PolicyInputError (one line) for inputs no placement can take."""
        import torch

        w = core.as_array(weight, "weight")
        result = _rebalanced(w, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices, NAMES,
                             core.engine_group(eplb_group))
        phy2log = _int64_tensor(result.phy2log)
        if cls.convention == "phy2log":
            return phy2log
        log2phy, logcnt = core.logical_maps(result.phy2log, w.shape[1])
        if result.log2phy is not None:
            log2phy = result.log2phy
        return phy2log, torch.from_numpy(np.ascontiguousarray(log2phy)), torch.from_numpy(logcnt)

    def plan_rebalance(self, context: Any, policy_state: Any = None) -> Any:
        """vLLM's planning entry point where the policy is an instance (its sources after 0.33.0): `context`, an
        `EplbRebalanceContext`, holds the load window [samples, L, E] (summed over the samples, as vLLM's legacy
        adapter sums it), the serving map [L, P], the topology, the physical expert count and the EP ranks' CPU
        group, on which the ranks agree on one map (`core.agree`). Returns vLLM's `EplbPlan` of the int64 CPU map
        [L, P] `rebalance_experts` answers for the same inputs. `policy_state` (absent in one version of the
        interface) is read-only here and unused: eplb keeps no state between rebalances."""
        topology = context.topology
        cpu_group = context.cpu_group
        result = _rebalanced(context.load_window_cpu, context.num_replicas, topology.num_groups, topology.num_nodes,
                             topology.num_ranks, context.physical_to_logical_map_cpu, PLAN_NAMES,
                             core.engine_group(lambda: cpu_group))
        plan = importlib.import_module(POLICY_MODULE).EplbPlan
        return plan(_int64_tensor(result.phy2log))


def _rebalanced(weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int, old: Any,
                names: core.Arguments, group: Any) -> core.Rebalanced:
    """`core.rebalance`, logged in vLLM's log (a WARNING when it fell back): both entry points' one solve."""
    result = core.rebalance(weight, num_replicas, num_groups, num_nodes, num_ranks, old, names=names, group=group)
    level = logging.WARNING if result.fell_back else logging.INFO
    logger.log(level, "eplb policy (%s): %s", result.source, result.how)
    if result.warning:
        core.warn_once(logger, f"eplb policy: {result.warning}")
    return result


def _int64_tensor(array: Any) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))


def eplb_group() -> Any:
    """The CPU (gloo) group of vLLM's EPLB ranks, each of which calls the policy with the same loads and map: newer
    vLLM's `get_eplb_group()`, else `get_ep_group()` (`vllm.distributed.parallel_state`; `EplbState.rearrange` moves
    weights over that group's ranks, and its async worker calls the policy, then all-reduces on it)."""
    state = importlib.import_module("vllm.distributed.parallel_state")
    find = getattr(state, "get_eplb_group", None) or state.get_ep_group
    return find().cpu_group


class EplbTuplePolicy(EplbPolicy):
    """The same policy with the older return convention `(phy2log, log2phy, logcnt)`."""

    convention: ClassVar[Convention] = "tuple"


def policy_class(convention: Convention) -> type[EplbPolicy]:
    """The policy class for a return convention ("phy2log" or "tuple")."""
    if convention not in ("phy2log", "tuple"):
        raise ValueError(f"convention must be 'phy2log' or 'tuple', got {convention!r}")
    return EplbPolicy if convention == "phy2log" else EplbTuplePolicy


def detect_convention(abstract_policy: type) -> Convention:
    """Which convention a vLLM abstract policy class declares: "tuple" when its `rebalance_experts`
    is annotated to return a tuple, "phy2log" when it returns one tensor; without an annotation, the
    versions that take `old_global_expert_indices` return phy2log."""
    signature = inspect.signature(getattr(abstract_policy, "rebalance_experts"))  # noqa: B009 (any class)
    annotation = signature.return_annotation
    if annotation is not inspect.Signature.empty:
        text = annotation if isinstance(annotation, str) else repr(annotation)
        return "tuple" if "tuple" in text.lower() else "phy2log"
    return "phy2log" if "old_global_expert_indices" in signature.parameters else "tuple"


def register() -> None:
    """Entry point of the `vllm.general_plugins` group (vLLM calls it in every process; idempotent).

    Adds eplb's policy to vLLM's table as "eplb"; with EPLB_VLLM_POLICY=eplb also under "default".
    vLLM versions without the policy table (their EPLB calls `rebalance_algo.rebalance_experts`) get that
    function replaced in `eplb_state` when EPLB_VLLM_POLICY=eplb. Logs one line saying what it did; a
    no-op with a log line when vLLM is not installed. First checks every EPLB_* setting by the rules of every
    rebalance (`core.check_environment`): PolicyInputError for a value no rebalance can use, so vLLM does not start
    with it; a WARNING, once, for a setting that does nothing (an unknown name, EPLB_VLLM_POLICY other than eplb, a
    service URL without a deployment or the reverse).
    """
    core.check_environment(logger)
    select = os.environ.get(SELECT_ENV, "").strip()
    if importlib.util.find_spec("vllm") is None:
        logging.getLogger(__name__).info("eplb plugin: vLLM is not installed; nothing registered")
        return
    try:
        policy_module = importlib.import_module("vllm.distributed.eplb.policy")
    except ImportError:
        _register_function(select == POLICY_NAME)
        return
    abstract = policy_module.AbstractEplbPolicy
    table: dict[str, Any] = policy_module.EPLB_POLICIES
    convention = detect_convention(abstract)
    existing = table.get(POLICY_NAME)
    if isinstance(existing, type) and issubclass(existing, EplbPolicy):
        cls: type = existing
    else:
        cls = types.new_class("EplbPolicy", (policy_class(convention), abstract))
        cls.__module__ = __name__
        table[POLICY_NAME] = cls
    selected = select == POLICY_NAME
    if selected:
        table["default"] = cls
    logger.info(
        "eplb plugin: policy %r registered in vLLM's EPLB_POLICIES (%s convention)%s",
        POLICY_NAME,
        convention,
        "; selected as 'default' (EPLB_VLLM_POLICY=eplb)" if selected else f"; set {SELECT_ENV}=eplb to use it",
    )


def _register_function(selected: bool) -> None:
    """vLLM before the policy table: its eplb_state imported `rebalance_experts` (3-tuple) by name."""
    try:
        state = importlib.import_module("vllm.distributed.eplb.eplb_state")
    except ImportError:
        logger.warning("eplb plugin: this vLLM has neither an EPLB policy table nor eplb_state; nothing registered")
        return
    if not selected:
        logger.info("eplb plugin: this vLLM has no EPLB policy table; set %s=eplb to replace its algorithm", SELECT_ENV)
        return
    setattr(state, "rebalance_experts", EplbTuplePolicy.rebalance_experts)  # noqa: B010 (a module of vLLM's)
    logger.info("eplb plugin: vllm.distributed.eplb.eplb_state.rebalance_experts replaced by eplb's (tuple convention)")
