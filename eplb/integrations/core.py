"""Engine-neutral part of the engine plug-ins: settings, the local solve, slot keeping, the service client.

Everything here works on numpy arrays; `eplb.integrations.vllm` and `.sglang` convert the engines'
torch tensors at the edge. Shapes follow DeepSeek EPLB and vLLM: `weight: [L, E]` tokens per logical
expert, `phy2log: [L, P]` logical expert per physical slot (slots numbered GPU by GPU, P = ranks x slots
per rank; -1 marks a slot an engine left unused), `log2phy: [L, E, X]` slots of each expert (-1 padded),
`logcnt: [L, E]` replicas per expert.
"""

from __future__ import annotations

import logging
import operator
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

import httpx
import numpy as np
from numpy.typing import NDArray

from eplb import retry
from eplb.errors import EplbError
from eplb.io.files import tensor_values
from eplb.io.windows import check_loads
from eplb.rules import (
    CLI_MAX_GPUS,
    DEPLOYMENT_NAME_RULE,
    api_key_refusal,
    is_deployment_name,
    timeout_refusal,
    url_refusal,
)
from solvers import registry
from solvers.greedy import rebalance_experts as deepseek_rebalance
from solvers.migration import count_moves, relabel_gpus
from solvers.registry import Options, Problem, SolverError
from solvers.validation import InvalidPlacement, validate_placement

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]

INCREMENTAL = "incremental"
"""Registry name of the incremental (move-budgeted) solver, used when the engine passes its current map."""
DEFAULT_SOLVER = "deepseek"
"""EPLB_SOLVER's default: DeepSeek EPLB's algorithm (the engines' own), exactly; also what places from scratch for
EPLB_SOLVER=incremental, which only edits a map."""
UNSERVABLE = {
    "milp-weighted": "it gives replicas weighted shares, and vLLM and SGLang send an expert's tokens evenly to its "
                     "replicas (milp places for even shares)",
    "greedy-coact": "it needs co-activation counts (which experts tokens choose together), which the engines do not "
                    "pass to a rebalancing policy (greedy places on the loads alone)",
}
"""Registered solvers the plug-ins cannot run, and why (`plugin_solvers` is every other one)."""
INCREMENTAL_LB_TOLERANCE = 1.01
"""Without a move budget, the incremental map is used when its mean lb is at most 1% above a fresh placement's."""


class PolicyInputError(ValueError, AssertionError):
    """Arguments no placement can satisfy. A ValueError with a one-line message; also an AssertionError,
    the type vLLM's and SGLang's own algorithms raise for the same inputs, so engine code that catches that
    keeps working."""


@dataclass(frozen=True)
class Settings:
    """What the plug-ins read from the environment (every field is one variable, see `from_env`).

    solver: one of `plugin_solvers`: the registry name for a fresh placement ("deepseek": exactly DeepSeek EPLB's
    output, the default; "greedy": eplb's greedy, lower lb; "milp"), or "incremental": the engine's map edited, the
    edit kept even where a fresh placement balances better (a map with -1 slots, or none: DEFAULT_SOLVER);
    max_moves: expert copies allowed per rebalance (whole model) when the engine passes its current map, None for
    no limit; service_url + deployment: remote mode;
    api_key: bearer token for the service; timeout_s: seconds to wait for the service's answer to one call,
    retries included (`eplb.retry.RETRIES`), before solving locally.
    """

    solver: str = DEFAULT_SOLVER
    max_moves: int | None = None
    service_url: str | None = None
    deployment: str | None = None
    api_key: str | None = None
    timeout_s: float = 5.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """EPLB_SOLVER, EPLB_MAX_MOVES, EPLB_SERVICE_URL, EPLB_DEPLOYMENT, EPLB_API_KEY, EPLB_SERVICE_TIMEOUT_S."""
        env = os.environ if env is None else env
        solver = _solver(env)
        max_moves = _parse(env, "EPLB_MAX_MOVES", int, None)
        try:  # the registry's rule for a move budget (the CLI's --max-moves, the service's max_moves)
            registry.check_options(INCREMENTAL, Options(max_moves=max_moves), True, {"max_moves": "EPLB_MAX_MOVES"})
        except SolverError as err:
            raise PolicyInputError(str(err)) from None
        timeout = _parse(env, "EPLB_SERVICE_TIMEOUT_S", float, 5.0)
        refused = timeout_refusal(timeout)  # the Python client's rule for its timeout
        if refused is not None:
            raise PolicyInputError(f"EPLB_SERVICE_TIMEOUT_S {refused}")
        api_key = env.get("EPLB_API_KEY") or None
        refused = None if api_key is None else api_key_refusal(api_key)
        if refused is not None:  # httpx would raise at the first request (UnicodeEncodeError for a non-ASCII key)
            raise PolicyInputError(f"EPLB_API_KEY (not shown) {refused}: give the service's key")
        return cls(
            solver=solver,
            max_moves=max_moves,
            service_url=env.get("EPLB_SERVICE_URL", "").strip().rstrip("/") or None,
            deployment=env.get("EPLB_DEPLOYMENT", "").strip() or None,
            api_key=api_key,
            timeout_s=timeout,
        )


VLLM_SELECT = "EPLB_VLLM_POLICY"
"""vLLM: `eplb` puts the plug-in's policy under vLLM's `default` name (`eplb.integrations.vllm`)."""
SGLANG_SELECT = "EPLB_SGLANG_ALGORITHM"
"""SGLang: `eplb` selects the plug-in's algorithm whatever --eplb-algorithm says (`eplb.integrations.sglang`)."""
SELECTED = "eplb"
"""The one value of VLLM_SELECT and SGLANG_SELECT that does something."""
ENV_NAMES = ("EPLB_SOLVER", "EPLB_MAX_MOVES", "EPLB_SERVICE_URL", "EPLB_DEPLOYMENT", "EPLB_API_KEY",
             "EPLB_SERVICE_TIMEOUT_S", VLLM_SELECT, SGLANG_SELECT)
"""Every environment variable the plug-ins read."""
_UNSELECTED = {VLLM_SELECT: "vLLM's own policy stays under 'default'",
               SGLANG_SELECT: "--eplb-algorithm alone selects the algorithm"}


def environment(env: Mapping[str, str] | None = None) -> tuple[Settings, list[str]]:
    """The settings every rebalance reads (`Settings.from_env`: PolicyInputError for a value no rebalance can use) and
    one line for each setting that does nothing or will not do what it says: an EPLB_* name the plug-ins do not read,
    a VLLM_SELECT / SGLANG_SELECT value other than SELECTED, a service URL without a deployment or the reverse (every
    rebalance solves locally), a URL that is no http(s) one, a deployment name the service cannot have."""
    env = os.environ if env is None else env
    settings = Settings.from_env(env)
    notes = []
    unknown = sorted(name for name in env if name.startswith("EPLB_") and name not in ENV_NAMES)
    if unknown:
        notes.append(f"{', '.join(unknown)} {'is no setting' if len(unknown) == 1 else 'are no settings'} of the "
                     f"engine plug-ins, ignored (they read {', '.join(ENV_NAMES)})")
    for name, unselected in _UNSELECTED.items():
        value = env.get(name, "").strip()
        if value not in ("", SELECTED):
            notes.append(f"{name}={value!r} is not {SELECTED!r}: {unselected}")
    url, deployment = settings.service_url, settings.deployment
    if (url is None) != (deployment is None):
        given, missing = ("EPLB_SERVICE_URL", "EPLB_DEPLOYMENT") if deployment is None else (
            "EPLB_DEPLOYMENT", "EPLB_SERVICE_URL")
        notes.append(f"{given} is set without {missing}: every rebalance solves locally")
    elif url is not None and deployment is not None:
        if url_refusal(url) is not None:
            notes.append(f"EPLB_SERVICE_URL={url!r} is no http(s) URL: every rebalance will solve locally")
        if not is_deployment_name(deployment):
            notes.append(f"{_bad_name(settings)}: every rebalance will solve locally")
    return settings, notes


_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def check_environment(log: logging.Logger, env: Mapping[str, str] | None = None) -> Settings:
    """At the engine's start (the plug-ins' `register`): `environment`'s settings, or its PolicyInputError raised, so a
    value no rebalance can use stops the start instead of the first rebalance; each of its notes logged as a WARNING
    once in the process."""
    settings, notes = environment(env)
    for note in notes:
        warn_once(log, f"eplb plugin: {note}")
    return settings


def warn_once(log: logging.Logger, message: str) -> None:
    """`message` logged as a WARNING the first time this process says it, and never again."""
    with _WARNED_LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    log.warning("%s", message)


def plugin_solvers() -> list[str]:
    """The EPLB_SOLVER values the plug-ins run: every registered solver but the UNSERVABLE ones, in registry order.
    `incremental` edits the engine's map (DEFAULT_SOLVER places when the engine passes none)."""
    return [name for name in registry.names() if name not in UNSERVABLE]


def _solver(env: Mapping[str, str]) -> str:
    """EPLB_SOLVER, one of `plugin_solvers`; PolicyInputError naming them otherwise (and why for an UNSERVABLE one)."""
    solver = env.get("EPLB_SOLVER", "").strip() or DEFAULT_SOLVER
    choices = ", ".join(plugin_solvers())
    if solver in UNSERVABLE:
        raise PolicyInputError(f"EPLB_SOLVER={solver!r} cannot serve an engine: {UNSERVABLE[solver]}; choose one of "
                               f"{choices}")
    if solver not in plugin_solvers():
        raise PolicyInputError(f"EPLB_SOLVER={solver!r}: choose one of {choices}")
    return solver


def _parse(env: Mapping[str, str], name: str, kind: type[Any], default: Any) -> Any:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise PolicyInputError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


@dataclass
class Rebalanced:
    """A new map and how it was made. source: "local", "remote" (the service's placement, or its `kept`), "kept"
    (the engine's map unchanged: the service answered a placement the engine refuses) or "rank N" (another EP rank's
    map, which every rank serves: `agree`); how: one line for the engine's log (solver, moves, fallback reason,
    reports to the service that failed); log2phy: DeepSeek's own replica order when the drop-in produced the map
    unchanged, else None (`logical_maps` derives it in slot order); fell_back: remote mode was asked for and failed
    on this rank (the plug-ins log a WARNING); warning: about a map that serves but is not what the engine asked for
    (the plug-ins log it as a WARNING once in the process)."""

    phy2log: IntArray
    source: str
    how: str
    log2phy: IntArray | None = None
    fell_back: bool = False
    warning: str | None = None


@dataclass(frozen=True)
class Arguments:
    """What an engine calls the arguments of a rebalance, for the errors that name them (the defaults are vLLM's, the
    names `rebalance` takes). windows: the loads may come as [W, L, E] recorded windows, summed over W (SGLang's)."""

    weight: str = "weight"
    num_replicas: str = "num_replicas"
    num_groups: str = "num_groups"
    num_nodes: str = "num_nodes"
    num_ranks: str = "num_ranks"
    old: str = "the engine's map"
    windows: bool = False


def whole(value: Any, name: str) -> int:
    """`value` as an int: an int, a numpy integer or a 0-d integer tensor (`operator.index`); PolicyInputError naming
    `name` for a float (6.0 too), a bool or anything else."""
    if not isinstance(value, bool | np.bool_):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise PolicyInputError(f"{name} must be a whole number (an int), got {value!r} ({type(value).__name__})")


def as_array(value: Any, name: str, integer: bool = False) -> NDArray[Any]:
    """A tensor of any device and dtype (`eplb.io.files.tensor_values`) or an array-like (a list, a numpy array) as
    a numpy array: float64 for the loads, as given for a map (`integer`: `check_map` judges its dtype; bfloat16 and
    float8 read as float64); PolicyInputError naming `name` for a tensor on the meta device (no values) and what is
    no rectangular array of real numbers."""
    try:
        array = np.asarray(tensor_values(value, name))
        if array.dtype.kind == "c":
            raise PolicyInputError(f"{name} must hold real numbers, got {array.dtype}")
        if array.dtype.kind not in "biuf":
            raise TypeError(array.dtype)
        return array if integer else array.astype(np.float64, copy=False)
    except PolicyInputError:
        raise
    except EplbError as err:
        raise PolicyInputError(str(err)) from None
    except (TypeError, ValueError, RuntimeError):
        raise PolicyInputError(f"{name} must be a rectangular array of numbers (a tensor, a numpy array or nested "
                               f"lists), got a {type(value).__name__}") from None


def positive(value: int, name: str) -> int:
    """`value` when it is >= 1; PolicyInputError naming `name` otherwise."""
    if value < 1:
        raise PolicyInputError(f"{name} must be >= 1, got {value}")
    return value


def loads(value: Any, names: Arguments = Arguments()) -> FloatArray:
    """The engine's loads as a [L, E] float64 window (`as_array`): [layers, experts] with at least one of each, or, for
    `names.windows`, also [W, L, E] windows summed over W; token counts by the rule of the CLI's and the service's
    windows (`check_loads`: finite, >= 0, at most MAX_LOAD, each window's entry and then their sum). PolicyInputError
    naming `names.weight` and the first bad entry otherwise."""
    weight = as_array(value, names.weight)
    shapes = "[layers, experts] or [windows, layers, experts]" if names.windows else "[layers, experts]"
    if weight.ndim not in ((2, 3) if names.windows else (2,)) or 0 in weight.shape:
        raise PolicyInputError(f"{names.weight} must be {shapes} with at least one of each, got shape "
                               f"{tuple(weight.shape)}")
    try:
        return check_loads(weight, names.weight)
    except EplbError as err:
        raise PolicyInputError(str(err)) from None


def check_inputs(
    weight: FloatArray, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
    names: Arguments = Arguments(),
) -> None:
    """Raise PolicyInputError for arguments no placement can satisfy (one line naming the engine's argument, `names`,
    and what to change). weight: [L, E] (`loads`)."""
    for name, value in ((names.num_replicas, num_replicas), (names.num_groups, num_groups),
                        (names.num_nodes, num_nodes), (names.num_ranks, num_ranks)):
        positive(value, name)
    if num_replicas % num_ranks:
        raise PolicyInputError(f"{names.num_replicas} ({num_replicas}) must be a multiple of {names.num_ranks} "
                               f"({num_ranks})")
    if num_replicas < weight.shape[1]:
        raise PolicyInputError(f"{names.num_replicas} ({num_replicas}) must be >= the number of experts "
                               f"({weight.shape[1]}, the last dimension of {names.weight})")
    if num_ranks > CLI_MAX_GPUS:  # the Python API's and the CLI's bound on GPUs (a huge value crashed the kernels)
        raise PolicyInputError(f"{names.num_ranks} ({num_ranks:,}) is more EP ranks than eplb places (at most "
                               f"{CLI_MAX_GPUS:,})")
    if num_replicas // num_ranks > weight.shape[1]:  # the rule of every cluster (`eplb.budget.slots_beyond_experts`)
        raise PolicyInputError(f"{names.num_replicas} ({num_replicas:,}) over {names.num_ranks} ({num_ranks:,}) is "
                               f"{num_replicas // num_ranks:,} slots per rank but only {weight.shape[1]} experts (the "
                               f"last dimension of {names.weight}): a rank never needs more slots than there are "
                               "experts (extra slots would only hold a second copy on the same rank)")
    if num_groups % num_nodes == 0:  # DeepSeek's hierarchical policy (the drop-in's, which places every window of
        # no tokens and every fallback): whole groups of experts onto nodes of equally many ranks
        why = (f"when {names.num_groups} ({num_groups}) is a multiple of {names.num_nodes} ({num_nodes}), DeepSeek's "
               "hierarchical policy packs whole expert groups onto nodes of equally many ranks")
        if weight.shape[1] % num_groups:
            raise PolicyInputError(f"{names.num_groups} ({num_groups}) must divide the number of experts "
                                   f"({weight.shape[1]}, the last dimension of {names.weight}): {why}")
        if num_ranks % num_nodes:
            raise PolicyInputError(f"{names.num_ranks} ({num_ranks}) must be a multiple of {names.num_nodes} "
                                   f"({num_nodes}): {why}")


def check_map(old: NDArray[Any] | None, weight: FloatArray, num_replicas: int, num_ranks: int, name: str) -> None:
    """PolicyInputError, naming `name` (the engine's argument), for an engine's map [L, P] of the engine's shape that no
    engine can serve: an id other than -1 (an unused slot) and 0..E-1 (`name[0][4] is 99: ...`), an expert without a
    slot in some layer, ids that are no integers. A map of another shape is no error: the placement is made from
    scratch (`solve_local`)."""
    if old is None or old.shape != (weight.shape[0], num_replicas):
        return
    try:
        validate_placement(old, np.full(num_ranks, num_replicas // num_ranks), weight.shape[1])
    except InvalidPlacement as err:
        why = str(err)  # the solvers call the map phy2log: say the engine's name for it instead
        raise PolicyInputError(name + why[len("phy2log"):] if why.startswith("phy2log") else f"{name}: {why}") from None


def hierarchical(num_groups: int, num_nodes: int, num_ranks: int, num_experts: int) -> bool:
    """DeepSeek's and vLLM's rule: groups packed onto nodes when num_groups % num_nodes == 0; it is a real
    constraint only with several nodes (one node is the global policy)."""
    divides = num_groups % num_nodes == 0 and num_ranks % num_nodes == 0 and num_experts % num_groups == 0
    return num_nodes > 1 and divides


def fresh(
    weight: FloatArray, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int, solver: str
) -> tuple[IntArray, IntArray | None]:
    """A placement from scratch: (phy2log [L, P], DeepSeek's log2phy or None). solver "deepseek" (and "incremental",
    which needs a map to edit) is the drop-in (same output as DeepSeek EPLB); any other of `plugin_solvers` runs
    through the registry."""
    if solver in (DEFAULT_SOLVER, INCREMENTAL):
        phy2log, log2phy, _ = deepseek_rebalance(weight, num_replicas, num_groups, num_nodes, num_ranks)
        return phy2log, log2phy
    slots = np.full(num_ranks, num_replicas // num_ranks, dtype=np.int64)
    hier = hierarchical(num_groups, num_nodes, num_ranks, weight.shape[1])
    problem = Problem(
        loads=weight.astype(np.float64),
        slots_per_gpu=slots,
        num_groups=num_groups if hier else None,
        gpus_per_node=num_ranks // num_nodes if hier else None,
    )
    return registry.solve(solver, problem).phy2log, None


def groups_across_nodes(phy2log: IntArray, num_groups: int, num_nodes: int) -> int:
    """Layers of phy2log [L, P] (-1: an empty slot) where one of the `num_groups` expert groups (DeepSeek's: experts in
    id order, E / num_groups each) has replicas on more than one of `num_nodes` equal blocks of slots."""
    layers, num_slots = phy2log.shape
    experts = int(phy2log.max(initial=-1)) + 1
    if experts == 0 or experts % num_groups or num_slots % num_nodes:
        return 0
    node = np.broadcast_to(np.arange(num_slots) // (num_slots // num_nodes), phy2log.shape)
    group = np.where(phy2log >= 0, phy2log // (experts // num_groups), num_groups)  # empty slots: a dropped group
    seen = np.zeros((layers, num_groups + 1, num_nodes), dtype=bool)
    seen[np.broadcast_to(np.arange(layers)[:, None], phy2log.shape), group, node] = True
    return int((seen[:, :num_groups].sum(axis=2) > 1).any(axis=1).sum())


def keep_slots(new: IntArray, old: IntArray, num_ranks: int, node_blocks: int) -> IntArray:
    """Relabel the new placement's GPUs (within each of `node_blocks` equal blocks of GPUs, so expert groups
    stay on their nodes) to overlap the old one most, then put every expert that stays on a GPU in its old
    slot, as vLLM's `preserve_intragpu_slots` does. Replica counts and loads are unchanged; moves never grow.
    -1 slots in `old` hold nothing."""
    num_experts = int(max(new.max(), old.max())) + 1
    old_clean = np.where(old < 0, num_experts, old)  # a phantom expert that no new slot holds
    per_block = new.shape[1] // node_blocks
    spg = new.shape[1] // num_ranks
    out = np.empty_like(new)
    for b in range(node_blocks):  # over nodes (1 for the global policy); each call covers every layer
        cols = slice(b * per_block, (b + 1) * per_block)
        out[:, cols] = relabel_gpus(new[:, cols], old_clean[:, cols], np.full(num_ranks // node_blocks, spg))
    return out


def moves(new: IntArray, old: IntArray, num_ranks: int) -> IntArray:
    """[L] expert copies onto GPUs that did not hold the expert (GPUs as labelled; -1 slots hold nothing)."""
    num_experts = int(max(new.max(), old.max())) + 1
    spg = new.shape[1] // num_ranks
    return count_moves(
        np.where(new < 0, num_experts, new), np.where(old < 0, num_experts, old), np.full(num_ranks, spg)
    )


def layer_lb(weight: FloatArray, phy2log: IntArray, num_ranks: int) -> FloatArray:
    """[L] max GPU load / mean GPU load with uniform shares; -1 slots carry nothing."""
    layers, num_experts = weight.shape
    valid = phy2log >= 0
    safe = np.where(valid, phy2log, 0)
    counts = np.zeros((layers, num_experts), dtype=np.float64)
    np.add.at(counts, (np.repeat(np.arange(layers), phy2log.shape[1]), safe.ravel()), valid.ravel())
    per_slot = np.take_along_axis(weight / np.maximum(counts, 1), safe, axis=1) * valid
    gpu = per_slot.reshape(layers, num_ranks, -1).sum(axis=2)
    mean = gpu.mean(axis=1)
    return np.asarray(np.where(mean > 0, gpu.max(axis=1) / np.where(mean > 0, mean, 1), 1.0), dtype=np.float64)


def within_budget(weight: FloatArray, new: IntArray, old: IntArray, num_ranks: int, max_moves: int) -> IntArray:
    """Keep the new map only in the layers that buy the most lb per copy, within max_moves copies in all;
    every other layer keeps its old map. For the fresh placements `solve_local` makes from a map the incremental
    solver does not edit (one with -1 slots, or one it refused)."""
    per_layer = moves(new, old, num_ranks)
    if int(per_layer.sum()) <= max_moves:
        return new
    gain = layer_lb(weight, old, num_ranks) - layer_lb(weight, new, num_ranks)
    worth = np.where(per_layer > 0, gain / np.maximum(per_layer, 1), np.inf)
    out = old.copy()
    spent = 0
    for layer in np.argsort(-worth, kind="stable"):  # over layers, best value first
        cost = int(per_layer[layer])
        if gain[layer] > 0 and spent + cost <= max_moves:
            out[layer] = new[layer]
            spent += cost
    return out


def solve_local(
    weight: FloatArray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: IntArray | None,
    settings: Settings,
) -> Rebalanced:
    """The local answer. Without a usable old map: `fresh` (DeepSeek-equal by default). With one: the
    registry's incremental solver under `max_moves` when the map has no -1 slots (without a budget, its edit stands
    only within INCREMENTAL_LB_TOLERANCE of a fresh placement's lb, unless EPLB_SOLVER=incremental), else `fresh`,
    then `within_budget`; in both cases followed by `keep_slots`."""
    layers, num_experts = weight.shape
    placer = DEFAULT_SOLVER if settings.solver == INCREMENTAL else settings.solver  # what places from scratch
    if old is None or old.shape != (layers, num_replicas):
        phy2log, log2phy = fresh(weight, num_replicas, num_groups, num_nodes, num_ranks, placer)
        note = "" if old is None else f" (old map {tuple(old.shape)} does not match; placed from scratch)"
        if old is None and settings.solver == INCREMENTAL:
            note = f" ({INCREMENTAL} edits the engine's map, and it passed none)"
        return Rebalanced(phy2log, "local", f"{placer}{note}", log2phy)
    hier = hierarchical(num_groups, num_nodes, num_ranks, num_experts)
    blocks = num_nodes if hier else 1
    how = ""
    new: IntArray | None = None
    if (old < 0).any() and settings.solver == INCREMENTAL:
        how = f"{placer} ({INCREMENTAL} edits a map with every slot filled; this one has -1 slots)"
    if not (old < 0).any():
        problem = Problem(
            loads=weight.astype(np.float64),
            slots_per_gpu=np.full(num_ranks, num_replicas // num_ranks, dtype=np.int64),
            num_groups=num_groups if hier else None,
            gpus_per_node=num_ranks // num_nodes if hier else None,
            current_phy2log=old,
        )
        try:
            new = registry.solve(INCREMENTAL, problem, Options(max_moves=settings.max_moves)).phy2log
            how = INCREMENTAL
        except SolverError as err:
            how = f"{placer} ({INCREMENTAL} refused: {err})"
    if new is not None and settings.max_moves is None and settings.solver != INCREMENTAL:
        # without a budget, edits must not cost balance: the incremental map stands only when its lb is within
        # INCREMENTAL_LB_TOLERANCE of a fresh placement's (hierarchical edits cannot move a group to another
        # node, which a fresh placement may need)
        candidate, _ = fresh(weight, num_replicas, num_groups, num_nodes, num_ranks, placer)
        kept_lb, fresh_lb = (float(layer_lb(weight, m, num_ranks).mean()) for m in (new, candidate))
        if kept_lb > fresh_lb * INCREMENTAL_LB_TOLERANCE:
            new, how = None, f"{placer} (incremental lb {kept_lb:.4f} vs fresh {fresh_lb:.4f})"
    if new is None:
        new, _ = fresh(weight, num_replicas, num_groups, num_nodes, num_ranks, placer)
        new = keep_slots(new, old, num_ranks, blocks)
        if settings.max_moves is not None:
            new = within_budget(weight, new, old, num_ranks, settings.max_moves)
        how = how or placer
    else:
        new = keep_slots(new, old, num_ranks, blocks)
    budget = "no limit" if settings.max_moves is None else f"budget {settings.max_moves}"
    return Rebalanced(new, "local", f"{how}, {int(moves(new, old, num_ranks).sum())} copies ({budget})")


# The retry rule of `Service`'s calls is eplb.retry's, shared with eplb.client. A window that failed falls back to a
# local solve (which `agree` replaces by another rank's answer from the service, if any rank got one), so the
# plug-in sends the same request again for what another attempt can mend, within `Settings.timeout_s`.


FailureKind = Literal["unreachable", "error", "refused", "other-cluster"]


class Failure(str):
    """A one-line reason the service's answer cannot be used, and its kind: "unreachable" (no answer: refused, timed
    out, a bad deployment name), "error" (an error status, not JSON), "refused" (a placement the engine cannot
    serve: wrong layers, not every expert placed) or "other-cluster" (a placement for another cluster shape, or the
    engine's map refused by the deployment: it is not for the engine's cluster or model)."""

    kind: FailureKind

    def __new__(cls, text: str, kind: FailureKind = "error") -> Failure:
        self = super().__new__(cls, text)
        self.kind = kind
        return self


NO_ROUTE = "Not Found"
"""The detail of a 404 for a path the service has no route for (the web framework's), not for an unknown deployment."""
UNCHANGED = "unchanged"
"""`post_window`'s answer when the service kept the placement it holds (action kept)."""
CURRENT = "current_placement"
"""The window's field for the engine's map (POST /deployments/{name}/windows)."""


class Service:
    """The calls the plug-ins make to the service's deployment `settings.deployment`, on one httpx client (the
    caller's, or one of our own with `settings.timeout_s`, closed by `close`). Each answers a value or a `Failure`."""

    def __init__(self, settings: Settings, client: httpx.Client | None = None) -> None:
        assert settings.service_url is not None and settings.deployment is not None
        self.settings = settings
        self.url = f"{settings.service_url}/deployments/{quote(settings.deployment, safe='')}"
        self._own = client is None
        self._http = httpx.Client(timeout=settings.timeout_s) if client is None else client
        self._headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}

    def close(self) -> None:
        if self._own:
            self._http.close()

    def _json(self, method: str, url: str, body: Any = None) -> Any:
        """The answer's JSON, or a Failure naming the URL: no answer, 404, another error status, not JSON. What another
        attempt can mend (a 502, 503 or 504, a connection refused or reset before an answer, no answer in time) is
        tried again, the same request, within `Settings.timeout_s` (`eplb.retry`: the rule, and why that is safe); the
        Failure then lists every attempt's outcome with the seconds it waited."""
        timeout = self.settings.timeout_s

        def attempt(wait: float) -> httpx.Response:
            return self._http.request(method, url, json=body, headers=self._headers, timeout=wait)

        attempts = retry.send(attempt, timeout)
        final = attempts.final
        assert final is not None
        if not retry.mendable(final):  # an answer to read, or an exception no retry helps (a bad URL, no http(s))
            answer = self._answer(url, final) if isinstance(final, httpx.Response) else Failure(
                f"{url} unreachable ({type(final).__name__}: {final})", "unreachable")
            earlier = attempts.earlier()
            if earlier and isinstance(answer, Failure):  # what came before it, said too
                return Failure(f"{answer} (attempt {attempts.made}, after {earlier})", answer.kind)
            return answer
        kind: FailureKind = "error" if isinstance(final, httpx.Response) else "unreachable"
        if len(attempts.failed) == 1:  # one attempt, said naming the URL
            ((result, waited),) = attempts.failed
            if isinstance(result, httpx.TimeoutException):
                return Failure(f"no answer from {url} within {retry.seconds(waited)} s", kind)
            return Failure(f"{url} {retry.said(result, waited)}", kind)
        return Failure(f"{url} failed {len(attempts.failed)} attempts within {retry.seconds(timeout)} s: "
                       f"{attempts.history()}", kind)

    def _answer(self, url: str, response: httpx.Response) -> Any:
        """An answer not sent again as `_json` returns it: its JSON, or a Failure for 404, another error, not JSON."""
        if response.status_code == 404:
            why = retry.detail(response).strip()
            if why and why != NO_ROUTE:  # the service's own: "no deployment named 'prod': register it with PUT ..."
                return Failure(f"{url} answered 404: {why}")
            return Failure(f"{url} answered 404 ({why or 'no detail'}): no such route there; is EPLB_SERVICE_URL "
                           f"({self.settings.service_url}) the base URL `eplb serve` listens on (http://HOST:PORT, "
                           "with no path unless a proxy serves it under one), and does that service keep deployments?")
        if response.status_code == 422 and _names_field(response, CURRENT):
            why = retry.detail(response)
            return Failure(f"{url} refused the engine's map as the window's current placement ({why})", "other-cluster")
        if response.status_code == 401:
            key = "EPLB_API_KEY is not set" if not self.settings.api_key else "EPLB_API_KEY is not the service's key"
            return Failure(f"{url} answered 401: {retry.detail(response)} ({key})")
        if response.status_code >= 400:
            return Failure(f"{url} answered {response.status_code}: {retry.detail(response)}")
        try:
            return response.json()
        except ValueError:
            return Failure(f"{url} answered {response.status_code} with a body that is not JSON")

    def current(self, weight: FloatArray, num_replicas: int, num_ranks: int) -> IntArray | Failure | None:
        """GET the deployment: the phy2log [L, P] it holds as serving, None when it holds none yet, or a Failure
        ("other-cluster" when its placement is for another cluster shape than the engine's)."""
        body = self._json("GET", self.url)
        if isinstance(body, Failure):
            return body
        if not isinstance(body, dict) or "config" not in body:
            return Failure(f"{self.url} answered something that is not a deployment")
        if body.get("placement") is None:
            return None
        return _usable(body["placement"], self.url, weight, num_replicas, num_ranks)

    def send_window(
        self, weight: FloatArray, num_replicas: int, num_ranks: int, current: IntArray | None = None,
        layer_ids: Sequence[int] | None = None,
    ) -> IntArray | str:
        """POST the window [L, E], with `current` [L, P] (the engine's map, every slot filled) as its
        current_placement, labelled with the rows' model `layer_ids` when given (the window itself has no such
        field): the new phy2log [L, P], UNCHANGED when the service kept its placement, or a Failure. Every rank
        sending the same window and map gets the same answer (the service's window key)."""
        url = f"{self.url}/windows"
        window: dict[str, Any] = {"loads": weight.tolist()}
        if current is not None:
            spg = current.shape[1] // num_ranks
            window[CURRENT] = {"phy2log": current.tolist(), "slots_per_gpu": [spg] * num_ranks}
            if layer_ids is not None:
                window[CURRENT]["layer_ids"] = [int(i) for i in layer_ids]
        body = self._json("POST", url, window)
        if isinstance(body, Failure):
            return body
        # POST /deployments/{name}/windows answers {"action": placed|rebalanced|kept, "result": {"placement": ...}}
        result = body.get("result") if isinstance(body, dict) else None
        placement = result.get("placement") if isinstance(result, dict) else None
        if placement is None:
            return UNCHANGED
        return _usable(placement, url, weight, num_replicas, num_ranks)


def _usable(placement: Any, url: str, weight: FloatArray, num_replicas: int, num_ranks: int) -> IntArray | Failure:
    """An answered placement's phy2log [L, P] when it is one for the cluster the engine asked for (`num_ranks` GPUs
    of `num_replicas / num_ranks` slots each: a deployment configured for another shape can answer the same [L, P])
    and places each expert; else a Failure saying why."""
    if not isinstance(placement, dict):
        return Failure(f"{url} answered a placement that is not an object", "refused")
    try:
        phy2log = np.asarray(placement["phy2log"])
    except (KeyError, TypeError, ValueError):
        phy2log = np.empty(0)
    if phy2log.dtype.kind not in "iu":  # 1.5 would be cast to expert 1
        return Failure(f"{url} answered a placement without an integer phy2log", "refused")
    phy2log = phy2log.astype(np.int64)
    slots = placement.get("slots_per_gpu")
    if not isinstance(slots, list) or not slots or not all(isinstance(n, int) for n in slots):
        return Failure(f"{url} answered a placement whose slots_per_gpu {slots!r} is not a list of counts, so the GPUs "
                       "cannot be checked", "refused")
    shape = _shape_mismatch(placement, num_replicas, num_ranks)
    if shape:
        return Failure(f"{url} answered a placement for another cluster ({shape}): set the deployment's cluster to "
                       "the engine's", "other-cluster")
    layers, num_experts = weight.shape
    if phy2log.shape != (layers, num_replicas):
        return Failure(f"{url} answered phy2log {phy2log.shape}, the engine needs {(layers, num_replicas)}", "refused")
    if phy2log.min() < 0 or phy2log.max() >= num_experts or not _every_expert(phy2log, num_experts):
        return Failure(f"{url} answered a phy2log that does not place each of the {num_experts} experts", "refused")
    return phy2log


def post_window(
    weight: FloatArray, num_replicas: int, num_ranks: int, settings: Settings, client: httpx.Client | None = None,
    current: IntArray | None = None,
) -> IntArray | str:
    """POST the window to the service's deployment (with `current`, the engine's [L, P] map, every slot filled);
    the new phy2log [L, P], "unchanged" when the service decided not to rebalance, or a one-line reason (a
    `Failure`) it could not be used. A placement is used only for the cluster the engine asked for: `num_ranks`
    GPUs of `num_replicas / num_ranks` slots each."""
    if not is_deployment_name(settings.deployment or ""):
        return _bad_name(settings)
    service = Service(settings, client)
    try:
        return service.send_window(weight, num_replicas, num_ranks, current)
    finally:
        service.close()


def _bad_name(settings: Settings) -> Failure:
    return Failure(f"EPLB_DEPLOYMENT={settings.deployment!r} is no deployment name the service can have "
                   f"({DEPLOYMENT_NAME_RULE})", "unreachable")


def _shape_mismatch(placement: dict[str, Any], num_replicas: int, num_ranks: int) -> str:
    """Which of the answer's num_gpus and slots_per_gpu disagree with the engine's ranks and slots per rank, as
    'field answered vs engine' (empty when both agree); its slots_per_gpu is a list of ints."""
    per_rank = num_replicas // num_ranks
    slots: list[int] = placement["slots_per_gpu"]
    gpus = placement.get("num_gpus", len(slots))
    wrong = []
    if gpus != num_ranks or len(slots) != num_ranks:
        answered = gpus if gpus == len(slots) else f"{gpus} (slots_per_gpu lists {len(slots)})"
        wrong.append(f"num_gpus {answered} vs the engine's {num_ranks} ranks")
    if any(n != per_rank for n in slots):
        answered = slots[0] if len(set(slots)) == 1 else _counts(slots)
        wrong.append(f"slots_per_gpu {answered} vs the engine's {per_rank} per rank")
    return ", ".join(wrong)


def _counts(slots: list[int]) -> str:
    """[4, 4, 5, 5] as '[4, 4, 5, 5]'; a long list cut after 8."""
    head = ", ".join(map(str, slots[:8]))
    return f"[{head}{', ...' if len(slots) > 8 else ''}]"


def _names_field(response: httpx.Response, field: str) -> bool:
    """Whether a problem answer's `errors` name `field` or a field inside it."""
    try:
        errors = response.json().get("errors")
    except (ValueError, AttributeError):
        return False
    names = [e.get("field") for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []
    return any(isinstance(n, str) and (n == field or n.startswith(f"{field}.")) for n in names)


def _every_expert(phy2log: IntArray, num_experts: int) -> bool:
    present = np.zeros((phy2log.shape[0], num_experts), dtype=bool)
    present[np.arange(phy2log.shape[0])[:, None], phy2log] = True
    return bool(present.all())


def rebalance(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: Any = None,
    settings: Settings | None = None,
    client: httpx.Client | None = None,
    names: Arguments = Arguments(),
    group: Any = None,
    layer_ids: Sequence[int] | None = None,
) -> Rebalanced:
    """Remote when EPLB_SERVICE_URL and EPLB_DEPLOYMENT are set (`remote`), else local; a window without tokens is
    answered here in both (`no_tokens`). weight: [L, E] tokens (or [W, L, E] windows for `names.windows`: `loads`);
    old: [L, P] the engine's current map (each a tensor, a numpy array or lists: `as_array`); the counts are ints
    (`whole`); names: the engine's names of these arguments, which every PolicyInputError uses; client: the httpx
    client for the service (default: one per call); group: the engine's CPU process group of the EP ranks that make
    this call together (`engine_group`), on which they `agree` on one map; None: this process's answer alone;
    layer_ids: the model layer of each row of weight (SGLang's MoE layers), sent as the current placement's."""
    settings = settings or Settings.from_env()
    num_replicas, num_groups, num_nodes, num_ranks = (
        whole(value, name) for value, name in ((num_replicas, names.num_replicas), (num_groups, names.num_groups),
                                               (num_nodes, names.num_nodes), (num_ranks, names.num_ranks)))
    weight = loads(weight, names)
    check_inputs(weight, num_replicas, num_groups, num_nodes, num_ranks, names)
    if old is not None:
        old = as_array(old, names.old, integer=True)
        check_map(old, weight, num_replicas, num_ranks, names.old)
        if old.shape == (weight.shape[0], num_replicas):
            old = old.astype(np.int64)
    url, deployment = settings.service_url, settings.deployment
    if not weight.any():
        result = no_tokens(weight, num_replicas, num_groups, num_nodes, num_ranks, old, settings)
    elif url is not None and deployment is not None:
        return remote(weight, num_replicas, num_groups, num_nodes, num_ranks, old, settings, client, group, layer_ids)
    else:
        result = solve_local(weight, num_replicas, num_groups, num_nodes, num_ranks, old, settings)
    if (url is None) != (deployment is None):
        given, missing = ("EPLB_SERVICE_URL", "EPLB_DEPLOYMENT") if deployment is None else (
            "EPLB_DEPLOYMENT", "EPLB_SERVICE_URL")
        result.how += f"; {given} is set without {missing}, so solved locally"
    return agree(result, group)


NO_TOKENS = "the window has no tokens"
"""How a window without tokens is logged (`no_tokens`)."""


def no_tokens(
    weight: FloatArray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: IntArray | None,
    settings: Settings,
) -> Rebalanced:
    """The answer to a window without tokens (weight [L, E] all zero: vLLM's start-up profile run calls the policy with
    one and discards the answer; an idle engine's window), made here and sent to no service: a placement made from no
    tokens is arbitrary, the service would only record a window of nothing, and what the engine does with the answer
    is unknown. The engine's map `old` [L, P] stays (in remote mode, for an engine that passes none, the map the
    plug-in answered last, `last_served`); without one, DeepSeek's placement (`fresh` with DEFAULT_SOLVER: the
    engines' default algorithm's answer). Nothing is remembered as served."""
    serving = old if old is not None and old.shape == (weight.shape[0], num_replicas) else None
    remote_mode = settings.service_url is not None and settings.deployment is not None
    if serving is None and remote_mode:
        serving = last_served(settings, weight.shape, num_replicas, num_ranks)
    unsent = f"; not sent to {settings.service_url}" if remote_mode else ""
    if serving is not None:
        return Rebalanced(serving.copy(), "local", f"{NO_TOKENS}: the serving map stays, 0 copies{unsent}")
    phy2log, log2phy = fresh(weight, num_replicas, num_groups, num_nodes, num_ranks, DEFAULT_SOLVER)
    return Rebalanced(phy2log, "local", f"{DEFAULT_SOLVER} ({NO_TOKENS} and no map serves){unsent}", log2phy)


_INHERITED_GROUPS = False
"""Set in a process forked from one whose torch.distributed was initialized: the groups it inherited share their
parent's connections, so no collective may run on them (`engine_group`)."""


def _forked() -> None:
    global _INHERITED_GROUPS
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        _INHERITED_GROUPS = True


os.register_at_fork(after_in_child=_forked)


def engine_group(find: Callable[[], Any]) -> Any:
    """The CPU process group `find()` answers (the engine's group of the EP ranks that call the policy together: a
    gloo group, as vLLM's and SGLang's `GroupCoordinator.cpu_group`), or None where no collective can run: one rank,
    torch.distributed not initialized (one process; a process the engine spawned to run the algorithm), the engine's
    group not set up (`find` raises), or a process forked from an initialized one (`_INHERITED_GROUPS`)."""
    if _INHERITED_GROUPS:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        group = find()
    except (ImportError, AttributeError, AssertionError, RuntimeError):  # no such group in this engine, or not yet
        return None
    return group if group is not None and dist.get_world_size(group) > 1 else None


def agree(result: Rebalanced, group: Any) -> Rebalanced:
    """The map every rank of `group` serves (None: `result` as it is): the map of the lowest rank whose own answer was
    no fallback (the service's answer, or the local solve in local mode), else rank 0's, so a request that failed on
    some ranks and was answered on others (`remote`) cannot leave the ranks on different placements, nor can a solve
    that differs from rank to rank. Every rank of the group must call it, as the engines call the policy on every EP
    rank; two collectives: an all-reduce of two ints, a broadcast of the [L, P] map. log2phy (DeepSeek's replica order)
    stays only when every rank has it, all solving the same placement locally; else each derives it from the map.
    A rank that serves another rank's map says so in `how`, after its own answer's."""
    if group is None:
        return result
    import torch
    import torch.distributed as dist

    size, me = dist.get_world_size(group), dist.get_rank(group)
    votes = torch.tensor([size if result.fell_back else me, 0 if result.log2phy is None else 1], dtype=torch.int64)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    answered, ordered = int(votes[0]), bool(votes[1])
    source = answered if answered < size else 0
    agreed = torch.tensor(result.phy2log, dtype=torch.int64)  # a copy: the broadcast writes into it
    dist.broadcast(agreed, src=dist.get_global_rank(group, source), group=group)
    phy2log = agreed.numpy()
    if np.array_equal(phy2log, result.phy2log):
        if not ordered:
            result.log2phy = None
        return result
    return Rebalanced(phy2log, f"rank {source}", f"the map of EP rank {source}, which every rank serves; this rank's "
                      f"own ({result.source}): {result.how}", None, result.fell_back, result.warning)


_SERVED: dict[tuple[str, int, int, int, int], IntArray] = {}
"""The map `remote` answered last, by (deployment, layers, slots, ranks): what the engine serves, whichever URL of
the service (a replica, a proxy) answered or failed."""
_SERVED_LOCK = threading.Lock()


def _served_key(settings: Settings, shape: tuple[int, ...], num_replicas: int,
                num_ranks: int) -> tuple[str, int, int, int, int]:
    """One map per deployment and cluster shape: weight's [layers, experts], the slots and the ranks."""
    layers, experts = shape[-2:]
    return settings.deployment or "", layers, experts, num_replicas, num_ranks


def last_served(settings: Settings, shape: tuple[int, ...], num_replicas: int, num_ranks: int) -> IntArray | None:
    """The phy2log [L, P] `remote` last answered in this process for the deployment of `settings` and this cluster
    shape (weight's [layers, experts], the slots, the ranks: what an engine that passes no map serves since), or
    None."""
    with _SERVED_LOCK:
        served = _SERVED.get(_served_key(settings, shape, num_replicas, num_ranks))
    return None if served is None else served.copy()


def forget_served() -> None:
    """Forget every map `remote` answered (as a restarted engine process starts)."""
    with _SERVED_LOCK:
        _SERVED.clear()


def remote(
    weight: FloatArray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: IntArray | None,
    settings: Settings,
    client: httpx.Client | None = None,
    group: Any = None,
    layer_ids: Sequence[int] | None = None,
) -> Rebalanced:
    """The deployment's answer to the window, in one request that every EP rank may send (vLLM and SGLang call the
    policy on each rank, with the same all-reduced load and map): the window carries `old` (the engine's map, every
    slot filled) as its current_placement, which the service records as serving first when it holds another, and
    the service answers the same window and map once, then with that answer again (its window key). An engine that
    passes no map (vLLM before old_global_expert_indices, SGLang without its expert location) serves the map this
    answered it last (`last_served`: in this process, for this deployment and cluster shape), which stands in for
    `old`: a fallback (3 below) or a refusal (2) reaches the deployment with the next window as with a map, and
    the local solve and `kept` start from what serves. Only the first window of a process without a map goes alone.

    1. A placement for the engine's cluster is served as answered: the service rebalanced from `old` and kept its
       slots (every expert that stays on a GPU stays in its slot), and holds that placement as serving. Only a map
       with -1 slots, which the deployment cannot hold and is not sent, has the answer relabelled here to keep its
       slots. `kept` serves `old` (an engine that passes no map: the deployment's placement, read then).
    2. An answer the engine refuses (another cluster shape, a wrong phy2log), or the engine's map refused by the
       deployment (not its cluster or model): `old` stays (a local solve without it).
    3. No answer, or an error status: a local solve from `old` (after more attempts of the same request for a 502,
       503 or 504, a connection refused or reset, or no answer in time: `eplb.retry` says how many and which).
    fell_back marks 2 and 3; `how` names the reason. Nothing else is sent: what the engine serves reaches the
    deployment with the next window. With the engine's `group`, the ranks `agree` on one of their answers (the
    service's when any rank got it), which is what the next window reports and `last_served` remembers."""
    if old is None:
        old = last_served(settings, weight.shape, num_replicas, num_ranks)
    result = agree(_remote(weight, num_replicas, num_groups, num_nodes, num_ranks, old, settings, client, layer_ids),
                   group)
    with _SERVED_LOCK:
        _SERVED[_served_key(settings, weight.shape, num_replicas, num_ranks)] = result.phy2log.copy()
    return result


def _remote(
    weight: FloatArray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: IntArray | None,
    settings: Settings,
    client: httpx.Client | None,
    layer_ids: Sequence[int] | None = None,
) -> Rebalanced:
    """`remote`'s answer from the engine's map `old` (or None: the first window of an engine that passes none); the
    rows' model `layer_ids` go with the map."""
    args = (weight, num_replicas, num_groups, num_nodes, num_ranks, old, settings)
    if not is_deployment_name(settings.deployment or ""):
        return _instead(_bad_name(settings), *args)
    where = f"{settings.service_url} deployment {settings.deployment!r}"
    serving = old if old is not None and old.shape == (weight.shape[0], num_replicas) else None
    service = Service(settings, client)
    try:
        sent = serving if serving is not None and not (serving < 0).any() else None  # the deployment fills every slot
        answer = service.send_window(weight, num_replicas, num_ranks, sent, layer_ids)
        if isinstance(answer, np.ndarray):
            served = answer  # rebalanced from `sent`, its slots kept by the service, and held so
            hier = hierarchical(num_groups, num_nodes, num_ranks, weight.shape[1])
            if serving is not None and sent is None:  # rebalanced from the deployment's map: keep the engine's slots
                served = keep_slots(answer, serving, num_ranks, num_nodes if hier else 1)
            spread = groups_across_nodes(served, num_groups, num_nodes) if hier else 0
            warning = None if not spread else (
                f"{where} answered a placement that spreads expert groups over nodes on {spread} of "
                f"{served.shape[0]} layers, where the engine keeps each of its {num_groups} groups on one of its "
                f"{num_nodes} nodes (DeepSeek's hierarchical policy; a token then reaches more nodes): set the "
                f"deployment's cluster.gpus_per_node to {num_ranks // num_nodes} and cluster.num_groups to "
                f"{num_groups}")
            return Rebalanced(served, "remote", f"placement from {where}", warning=warning)
        if answer == UNCHANGED:
            kept = serving if serving is not None else service.current(weight, num_replicas, num_ranks)
            if isinstance(kept, np.ndarray):
                return Rebalanced(kept.copy(), "remote", f"{where} kept the current placement")
            answer = kept if isinstance(kept, Failure) else Failure("the service kept a placement it does not hold",
                                                                    "refused")
        assert isinstance(answer, Failure)
        return _instead(answer, *args)
    finally:
        service.close()


def _instead(
    failure: Failure,
    weight: FloatArray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: IntArray | None,
    settings: Settings,
) -> Rebalanced:
    """What the engine serves when the remote answer cannot be used: `old` after a refused placement (when it is
    the engine's [L, P] map), else a local solve from it; fell_back set, `how` naming the failure."""
    refused = failure.kind in ("refused", "other-cluster")
    if refused and old is not None and old.shape == (weight.shape[0], num_replicas):
        result = Rebalanced(old.copy(), "kept", f"the serving placement stays; remote refused: {failure}")
    else:
        result = solve_local(weight, num_replicas, num_groups, num_nodes, num_ranks, old, settings)
        result.how += f"; remote failed, solved locally: {failure}"
    result.fell_back = True
    return result


def logical_maps(phy2log: IntArray, num_experts: int) -> tuple[IntArray, IntArray]:
    """(log2phy [L, E, X] slots of each expert in slot order, -1 padded; logcnt [L, E]); -1 slots skipped."""
    layers, num_physical = phy2log.shape
    valid = phy2log >= 0
    safe = np.where(valid, phy2log, num_experts)  # unused slots go to a dropped extra column
    counts = np.zeros((layers, num_experts + 1), dtype=np.int64)
    rows = np.repeat(np.arange(layers), num_physical)
    np.add.at(counts, (rows, safe.ravel()), 1)
    logcnt = counts[:, :num_experts]
    width = max(int(logcnt.max(initial=0)), 1)
    order = np.argsort(safe, axis=1, kind="stable")  # slots grouped by expert, in slot order
    sorted_expert = np.take_along_axis(safe, order, axis=1)
    start = np.concatenate([np.zeros((layers, 1), dtype=np.int64), np.cumsum(counts, axis=1)[:, :-1]], axis=1)
    rank = np.arange(num_physical)[None, :] - np.take_along_axis(start, sorted_expert, axis=1)
    log2phy = np.full((layers, num_experts + 1, width), -1, dtype=np.int64)
    keep = sorted_expert < num_experts
    log2phy[np.broadcast_to(np.arange(layers)[:, None], order.shape)[keep], sorted_expert[keep], rank[keep]] = order[
        keep
    ]
    return log2phy[:, :num_experts], logcnt
