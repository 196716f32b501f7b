"""SGLang EPLB algorithm plug-in: `--eplb-algorithm eplb` runs eplb's placement.

SGLang picks its algorithm in `sglang.srt.eplb.eplb_algorithms`: `compute_algorithm(raw_algorithm,
num_groups, num_nodes)` turns the `--eplb-algorithm` string into an `EplbAlgorithm` enum member and
`rebalance_experts(tokens_per_expert, num_physical_experts, num_local_physical_experts, num_groups,
num_nodes, algorithm)` dispatches on it; callers look both up on the module at call time. The enum is
closed, so `register()` (the `sglang.srt.plugins` entry point) adds two AROUND hooks through SGLang's
own `HookRegistry`, and patches nothing else:

- `eplb_algorithms.compute_algorithm`: answers `EPLB` for "eplb" (or for any value but "elasticity_aware" when
  EPLB_SGLANG_ALGORITHM=eplb); every other name goes to SGLang's function unchanged;
- `eplb_algorithms.rebalance_experts`: answers with eplb's placement when the algorithm is `EPLB`, unless SGLang's
  elastic EP state has an inactive rank (then SGLang's elasticity_aware algorithm places); every SGLang algorithm
  goes to SGLang's function unchanged.

The static path needs no plug-in: `eplb export --to sglang` writes an `--init-expert-location` file.
torch is imported lazily.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.integrations import core
from eplb.io.exports import ranges
from eplb.io.files import plural

ALGORITHM_NAME = core.SELECTED
SELECT_ENV = core.SGLANG_SELECT
TARGET_MODULE = "sglang.srt.eplb.eplb_algorithms"
ELASTIC = "elasticity_aware"
"""SGLang's algorithm for elastic EP (its server args set it for "auto" with --elastic-ep-backend): it leaves the slots
of failed ranks without routed experts, which eplb's placement does not, so it is always SGLang's."""
ELASTIC_MODULE = "sglang.srt.elastic_ep.elastic_ep"
DENSE = "placed as SGLang's deepseek algorithm places a layer of no tokens"
"""How the rows of SGLang's dense layers are answered (`_moe_layers`), as the log line says it."""

logger = logging.getLogger(__name__)


class EplbAlgorithm:
    """The algorithm value `compute_algorithm` answers for "eplb" (SGLang's own enum members are untouched);
    `.name` like an enum member's, for SGLang code that logs it."""

    name = ALGORITHM_NAME
    value = ALGORITHM_NAME

    def __repr__(self) -> str:
        return "EplbAlgorithm.eplb"


EPLB = EplbAlgorithm()


def rebalance_experts(
    tokens_per_expert: Any,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: int | None,
    num_nodes: int,
    algorithm: Any = EPLB,
    current_phy2log: Any = None,
) -> tuple[Any, Any, Any]:
    """SGLang's `rebalance_experts` contract with eplb's placement.

    tokens_per_expert: [W, L, E] recorded windows (summed over W) or [L, E], one row per model layer: the rows without
    tokens are SGLang's dense layers (`_moe_layers`), and a window without any keeps the map; num_physical_experts: P, a
    multiple of num_local_physical_experts (slots per rank); num_groups None (or not a multiple of
    num_nodes) is the global policy, like SGLang's "auto"; current_phy2log: [L, P] the map now serving
    (default: SGLang's global expert-location metadata when it has one). Tensors of any device and dtype, numpy
    arrays or lists; the counts are ints (None for num_groups). Returns int64 CPU tensors phy2log [L, P], log2phy
    [L, E, X] (-1 padded) and logcnt [L, E]. PolicyInputError (one line) for inputs no placement can take.
    """
    import torch

    num_physical_experts = core.whole(num_physical_experts, "num_physical_experts")
    num_local_physical_experts = core.positive(core.whole(num_local_physical_experts, "num_local_physical_experts"),
                                               "num_local_physical_experts")
    num_nodes = core.positive(core.whole(num_nodes, "num_nodes"), "num_nodes")
    num_groups = None if num_groups is None else core.positive(core.whole(num_groups, "num_groups"), "num_groups")
    if num_physical_experts % num_local_physical_experts:
        raise core.PolicyInputError(
            f"num_physical_experts ({num_physical_experts}) must be a multiple of "
            f"num_local_physical_experts ({num_local_physical_experts})"
        )
    num_ranks = num_physical_experts // num_local_physical_experts
    groups = num_groups if num_groups is not None and num_groups % num_nodes == 0 else 1
    nodes = num_nodes if groups > 1 else 1
    current = current_phy2log if current_phy2log is not None else _serving_map()
    names = core.Arguments(
        weight="tokens_per_expert", windows=True, num_replicas="num_physical_experts", num_groups="num_groups",
        num_nodes="num_nodes", num_ranks="num_physical_experts / num_local_physical_experts",
        old="current_phy2log" if current_phy2log is not None else "SGLang's physical_to_logical_map")
    weight = core.loads(tokens_per_expert, names)  # [L, E], the windows summed: one row per model layer
    moe = np.asarray(weight.any(axis=1))  # [L] the MoE layers: SGLang's recorder counts no token in a dense layer
    group = core.engine_group(world_group)
    if moe.all() or not moe.any():  # no dense row, or a window without tokens (`core.no_tokens`)
        result = core.rebalance(weight, num_physical_experts, groups, nodes, num_ranks, current, names=names,
                                group=group)
        phy2log, ordered = result.phy2log, result.log2phy
    else:
        phy2log, ordered, result = _moe_layers(weight, moe, num_physical_experts, groups, nodes, num_ranks, current,
                                               names, group)
    level = logging.WARNING if result.fell_back else logging.INFO
    logger.log(level, "eplb algorithm (%s): %s", result.source, result.how)
    if result.warning:
        core.warn_once(logger, f"eplb algorithm: {result.warning}")
    log2phy, logcnt = core.logical_maps(phy2log, weight.shape[1])
    if ordered is not None:
        log2phy = ordered
    as_tensor = torch.from_numpy
    return (
        as_tensor(np.ascontiguousarray(phy2log, dtype=np.int64)),
        as_tensor(np.ascontiguousarray(log2phy)),
        as_tensor(logcnt),
    )


def _moe_layers(
    weight: core.FloatArray, moe: NDArray[np.bool_], num_physical: int, groups: int, nodes: int, num_ranks: int,
    current: Any, names: core.Arguments, group: Any,
) -> tuple[core.IntArray, core.IntArray | None, core.Rebalanced]:
    """SGLang's rows are model layers, dense ones included (`ModelConfigForExpertLocation.num_layers` is the model's
    `num_hidden_layers`: 61 for DeepSeek-V3, whose layers 0-2 are dense), and its recorder counts no token in a dense
    layer. weight: [L, E] tokens; moe: [L] the rows with tokens, the MoE layers. Those rows (and theirs of the map
    `current` [L, P]) are placed by `core.rebalance`, which sends the service their model layer ids with the map, the
    others as SGLang's default algorithm (DeepSeek's) places a row of no tokens (SGLang moves no weights for them:
    `EPLBManager` updates only layers with routed experts). Returns phy2log [L, P], log2phy [L, E, X] (DeepSeek's
    order, or None: `logical_maps` derives it) and the MoE rows' result."""
    old = None
    if current is not None:  # checked whole, so an error names SGLang's own row
        old = core.as_array(current, names.old, integer=True)
        core.check_map(old, weight, num_physical, num_ranks, names.old)
        if old.shape == (weight.shape[0], num_physical):
            old = old[moe]
    ids = np.flatnonzero(moe).tolist()
    result = core.rebalance(weight[moe], num_physical, groups, nodes, num_ranks, old, names=names, group=group,
                            layer_ids=ids)
    dense, dense_log2phy = core.fresh(np.zeros((int((~moe).sum()), weight.shape[1])), num_physical, groups, nodes,
                                      num_ranks, core.DEFAULT_SOLVER)
    phy2log = np.empty((weight.shape[0], num_physical), dtype=np.int64)
    phy2log[moe], phy2log[~moe] = result.phy2log, dense
    log2phy = None
    if result.log2phy is not None and dense_log2phy is not None:  # DeepSeek's order in every row: one -1 padded array
        width = max(result.log2phy.shape[2], dense_log2phy.shape[2])
        log2phy = np.full((*weight.shape, width), -1, dtype=np.int64)
        log2phy[moe, :, :result.log2phy.shape[2]] = result.log2phy
        log2phy[~moe, :, :dense_log2phy.shape[2]] = dense_log2phy
    dense_ids = np.flatnonzero(~moe).tolist()
    result.how += (f"; model layers {ranges(ids)} with tokens ({plural(len(ids), 'MoE layer')}), "
                   f"{ranges(dense_ids)} without (dense: {DENSE})")
    return phy2log, log2phy, result


def world_group() -> Any:
    """The CPU (gloo) group of SGLang's ranks, each of which runs `EPLBManager.rebalance` with the same all-reduced
    counts: `get_world_group().cpu_group` (`sglang.srt.distributed.parallel_state`), the ranks whose expert weights
    `expert_location_updater` moves with torch.distributed's world."""
    return importlib.import_module("sglang.srt.distributed.parallel_state").get_world_group().cpu_group


def _serving_map() -> Any:
    """SGLang's current physical_to_logical_map [L, P], or None outside SGLang or before it has one."""
    try:
        location = importlib.import_module("sglang.srt.eplb.expert_location")
        metadata = location.get_global_expert_location_metadata()
    except Exception:  # outside a running SGLang (or a version without it): place from scratch
        return None
    return None if metadata is None else getattr(metadata, "physical_to_logical_map", None)


def _argument(name: str, position: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs[name] if name in kwargs else (args[position] if len(args) > position else None)


def _selected(raw: Any) -> bool:
    """eplb's algorithm is asked for: the raw name "eplb", or EPLB_SGLANG_ALGORITHM=eplb."""
    return raw == ALGORITHM_NAME or os.environ.get(SELECT_ENV, "").strip() == ALGORITHM_NAME


def compute_algorithm_hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND hook for `compute_algorithm(raw_algorithm, num_groups, num_nodes)`, which SGLang calls in
    `ExpertLocationMetadata.init_by_eplb` (as the model runner starts from recorded counts, and at each rebalance).
    When eplb is selected, first the EPLB_* settings (`core.Settings.from_env`): their PolicyInputError stops SGLang
    there. "elasticity_aware" stays SGLang's, with a WARNING once when EPLB_SGLANG_ALGORITHM=eplb asked for eplb."""
    raw = _argument("raw_algorithm", 0, args, kwargs)
    if raw == ELASTIC or not _selected(raw):
        if raw == ELASTIC and _selected(raw):
            core.warn_once(logger, f"eplb algorithm: {SELECT_ENV}={ALGORITHM_NAME} is not applied to SGLang's "
                                   f"{ELASTIC} algorithm (elastic EP): SGLang's places, as eplb's placement does not "
                                   f"leave the slots of failed ranks empty")
        return original(*args, **kwargs)
    core.Settings.from_env()
    return EPLB


def _inactive_ranks() -> list[int]:
    """The EP ranks SGLang's elastic EP state marks inactive (`active_ranks` of `ElasticEPStateManager.instance()`, or
    of `get_elastic_ep_state()` in older versions: what SGLang's rebalance_experts gives its elasticity_aware
    algorithm); [] outside SGLang, without elastic EP, or with every rank active."""
    try:
        elastic = importlib.import_module(ELASTIC_MODULE)
        manager = getattr(elastic, "ElasticEPStateManager", None)
        state = manager.instance() if manager is not None else elastic.get_elastic_ep_state()
        active = None if state is None else state.active_ranks
    except Exception:  # outside a running SGLang (or a version without elastic EP): no rank is known to be down
        return []
    if active is None:
        return []
    return np.flatnonzero(core.as_array(active, "SGLang's active_ranks").reshape(-1) == 0).tolist()


def rebalance_experts_hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND hook for `rebalance_experts(tokens_per_expert, num_physical_experts,
    num_local_physical_experts, num_groups, num_nodes, algorithm)`. For `EPLB` while SGLang's elastic EP has an
    inactive rank, SGLang's elasticity_aware algorithm answers (a WARNING once per set of inactive ranks)."""
    if _argument("algorithm", 5, args, kwargs) is not EPLB:
        return original(*args, **kwargs)
    names = ("tokens_per_expert", "num_physical_experts", "num_local_physical_experts", "num_groups", "num_nodes")
    inactive = _inactive_ranks()
    if inactive:
        elastic = getattr(importlib.import_module(TARGET_MODULE).EplbAlgorithm, ELASTIC)
        core.warn_once(logger, f"eplb algorithm: EP {'rank' if len(inactive) == 1 else 'ranks'} {ranges(inactive)} "
                               f"of SGLang's elastic EP {'is' if len(inactive) == 1 else 'are'} inactive: SGLang's "
                               f"{ELASTIC} algorithm places, as eplb's placement does not leave the slots of failed "
                               f"ranks empty")
        if "algorithm" in kwargs:
            return original(*args, **{**kwargs, "algorithm": elastic})
        return original(*args[:5], elastic, *args[6:], **kwargs)
    tokens, physical, local, groups, nodes = (_argument(n, i, args, kwargs) for i, n in enumerate(names))
    return rebalance_experts(tokens, physical, local, groups, nodes, EPLB)


def register() -> None:
    """Entry point of the `sglang.srt.plugins` group: registers the two hooks with SGLang's HookRegistry
    (SGLang applies them after loading plug-ins). A no-op with a log line when SGLang is not installed or
    has no plug-in hooks (then use the `--init-expert-location` export path). First checks every EPLB_* setting by
    the rules of every rebalance (`core.check_environment`): a value no rebalance can use is logged as an ERROR and
    the hooks are registered all the same (SGLang's `load_plugins` logs what a plug-in raises and starts without it,
    so raising here would only leave SGLang's own algorithm serving); the compute_algorithm hook then raises that
    PolicyInputError when eplb is selected. A WARNING, once, for a setting that does nothing (an unknown name,
    EPLB_SGLANG_ALGORITHM other than eplb, a service URL without a deployment or the reverse)."""
    try:
        core.check_environment(logger)
    except core.PolicyInputError as err:
        logger.error("eplb plugin: %s; SGLang stops with this error when it selects the eplb algorithm (--eplb-"
                     "algorithm eplb or %s=eplb)", err, SELECT_ENV)
    if importlib.util.find_spec("sglang") is None:
        logger.info("eplb plugin: SGLang is not installed; nothing registered")
        return
    try:
        hooks = importlib.import_module("sglang.srt.plugins.hook_registry")
    except ImportError:
        logger.warning(
            "eplb plugin: this SGLang has no plug-in hooks (sglang.srt.plugins); nothing registered, "
            "use `eplb export --to sglang` and --init-expert-location instead"
        )
        return
    registry, around = hooks.HookRegistry, hooks.HookType.AROUND
    registry.register(f"{TARGET_MODULE}.compute_algorithm", compute_algorithm_hook, around)
    registry.register(f"{TARGET_MODULE}.rebalance_experts", rebalance_experts_hook, around)
    logger.info(
        "eplb plugin: hooks on %s.compute_algorithm and .rebalance_experts registered; "
        "--eplb-algorithm eplb (or %s=eplb) selects eplb's placement",
        TARGET_MODULE,
        SELECT_ENV,
    )
