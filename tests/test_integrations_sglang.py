"""The SGLang algorithm plug-in: SGLang's rebalance_experts contract, the two AROUND hooks, registration, remote
mode (every rank's call of one rebalance answered one map)."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eplb.integrations import core
from eplb.integrations import sglang as plugin
from tests.conftest import remote_mixtral_deployment
from tests.engine_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "fixtures" / "deepseek_eplb_golden.json").read_text())["cases"]
DECODE = np.array(json.loads((ROOT / "fixtures" / "sglang6017-dsv3-decode-in1000out1000.json").read_text())["loads"])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("EPLB_")]:
        monkeypatch.delenv(name)
    core.forget_served()  # each test's engine starts with nothing answered
    monkeypatch.setattr(core, "_WARNED", set())  # nor anything warned


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: f"{c['kind']}-{c['variant']}-{c['num_gpus']}")
def test_equals_sglangs_auto_deepseek_choice(case: dict[str, Any]) -> None:
    """SGLang's "auto" picks deepseek_hierarchical when groups divide over nodes, else deepseek: DeepSeek's rule,
    so the answer is DeepSeek's. SGLang passes recorded windows [W, L, E] and slots per rank, not ranks."""
    weight = torch.tensor(case["weight"], dtype=torch.float64)
    windows = torch.stack([weight * 0.25, weight * 0.75])
    per_rank = case["num_replicas"] // case["num_gpus"]
    out = plugin.rebalance_experts(windows, case["num_replicas"], per_rank, case["num_groups"], case["num_nodes"])
    assert [t.tolist() for t in out] == [case["phy2log"], case["log2phy"], case["logcnt"]]
    assert {t.dtype for t in out} == {torch.int64}


def test_what_sglangs_algorithms_guarantee() -> None:
    """Shapes, every expert placed, replicas summing to the slots, log2phy pointing at the expert's slots,
    num_groups None as the global policy, groups kept on their nodes otherwise."""
    tokens = torch.from_numpy(DECODE).unsqueeze(0)
    for groups, nodes in ((None, 4), (8, 4), (8, 3)):
        phy2log, log2phy, logcnt = plugin.rebalance_experts(tokens, 288, 9, groups, nodes)
        p = phy2log.numpy()
        assert p.shape == (58, 288) and logcnt.shape == (58, 256) and log2phy.shape[:2] == (58, 256)
        assert (logcnt.sum(dim=1) == 288).all() and (logcnt >= 1).all()
        for layer in (0, 57):
            for e in (0, 17, 255):
                slots = log2phy[layer, e].numpy()
                assert (p[layer, slots[slots >= 0]] == e).all() and (slots >= 0).sum() == logcnt[layer, e]
        if groups == 8 and nodes == 4:
            node_of_slot = np.repeat(np.arange(4), 72)
            for g in range(8):
                members = np.isin(p[0], np.arange(g * 32, (g + 1) * 32))
                assert np.unique(node_of_slot[members]).size == 1
    with pytest.raises(core.PolicyInputError, match="multiple of num_local_physical_experts"):
        plugin.rebalance_experts(tokens, 288, 7, None, 1)


def test_serving_map_moves_within_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    prefill = json.loads((ROOT / "fixtures" / "sglang6017-dsv3-prefill-in4096.json").read_text())["loads"]
    old, _, _ = plugin.rebalance_experts(torch.tensor(prefill), 288, 9, 8, 4)
    monkeypatch.setenv("EPLB_MAX_MOVES", "300")
    new, _, logcnt = plugin.rebalance_experts(torch.from_numpy(DECODE), 288, 9, 8, 4, current_phy2log=old)
    assert core.moves(new.numpy(), old.numpy(), 32).sum() <= 300
    assert (logcnt >= 1).all()


def test_lists_and_int_counts_are_taken_floats_and_bad_maps_are_refused() -> None:
    """SGLang's contract with lists and numpy counts as with tensors; a float count (TypeError) and a map with an id
    outside the experts (the solvers' InvalidPlacement) are one-line PolicyInputErrors naming the argument."""
    tokens, old = [[[10, 20, 30, 40]] * 2], [[0, 1, 2, 3, 0, 1]] * 2  # [W, L, E]
    expected = [t.tolist() for t in plugin.rebalance_experts(torch.tensor(tokens), 6, 3, None, 1, plugin.EPLB,
                                                             torch.tensor(old))]
    got = plugin.rebalance_experts(np.asarray(tokens), np.int64(6), 3, None, np.int32(1), plugin.EPLB,  # type: ignore[arg-type]
                                   old)
    assert [t.tolist() for t in got] == expected
    with pytest.raises(core.PolicyInputError, match=r"^num_physical_experts must be a whole number \(an int\), got "
                                                    r"6\.0 \(float\)$"):
        plugin.rebalance_experts(tokens, 6.0, 3, None, 1)  # type: ignore[arg-type]
    with pytest.raises(core.PolicyInputError, match=r"^current_phy2log\[1\]\[5\] is 7: expert ids run "
                                                    r"0\.\.3 \(-1 marks an empty slot\)$"):
        plugin.rebalance_experts(tokens, 6, 3, None, 1, plugin.EPLB, [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 7]])


def _windows(at: tuple[int, int, int] | None = None, value: float = 0.0) -> np.ndarray:
    """SGLang's recorded windows [W=3, L=2, E=4], 10 tokens each, `value` at `at`."""
    windows = np.full((3, 2, 4), 10.0)
    if at is not None:
        windows[at] = value
    return windows


@pytest.mark.parametrize(("args", "refused"), [
    ((np.ones(4), 8, 2, None, 1),
     "tokens_per_expert must be [layers, experts] or [windows, layers, experts] with at least one of each, got shape "
     "(4,)"),
    ((np.ones((1, 1, 2, 4)), 8, 2, None, 1), "tokens_per_expert must be [layers, experts] or [windows, layers, "
                                             "experts] with at least one of each, got shape (1, 1, 2, 4)"),
    ((_windows((1, 0, 2), np.nan), 8, 2, None, 1), "tokens_per_expert[1][0][2] is nan: loads must be finite numbers"),
    ((_windows((2, 1, 3), -1.0), 8, 2, None, 1), "tokens_per_expert[2][1][3] is -1: loads must be >= 0"),
    ((np.full((3, 2, 4), 9e14), 8, 2, None, 1),
     "tokens_per_expert summed over its 3 steps, [0][0] is 2700000000000000: larger than any token count (limit "
     "1e+15)"),
    ((_windows(), 2, 1, None, 1),
     "num_physical_experts (2) must be >= the number of experts (4, the last dimension of tokens_per_expert)"),
    ((_windows(), 0, 2, None, 1), "num_physical_experts must be >= 1, got 0"),
    ((_windows(), 8, 0, None, 1), "num_local_physical_experts must be >= 1, got 0"),
    ((_windows(), 8, 2, None, 0), "num_nodes must be >= 1, got 0"),
    ((_windows(), 8, 2, -3, 2), "num_groups must be >= 1, got -3"),
    ((_windows(), 8, 2, None, 1, plugin.EPLB, np.full((2, 8), 1.5)),
     "current_phy2log must hold integer expert ids, got float64"),
    ((_windows(), 8, 2, None, 1, plugin.EPLB, [[0] * 8] * 2),
     "current_phy2log: logical expert 1 has no replica in layer 0 (6 missing in all)"),
])
def test_errors_name_sglangs_arguments_and_what_is_wrong(args: tuple[Any, ...], refused: str) -> None:
    """Errors named the plug-in's variables (weight[0][2], num_replicas, phy2log[0][3]) and indexed the windows' sum,
    a negative count in one window was hidden by the sum and a num_nodes of 0 or num_groups of -3 were taken: each is
    one line naming SGLang's argument (an entry of tokens_per_expert at its own index) and what is wrong."""
    with pytest.raises(core.PolicyInputError) as err:
        plugin.rebalance_experts(*args)
    assert str(err.value).startswith(refused) and "\n" not in str(err.value)


def test_compute_algorithm_hook_selects_eplb_only_for_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def sglang_compute_algorithm(raw_algorithm: str, num_groups: int | None, num_nodes: int) -> str:
        calls.append((raw_algorithm, num_groups, num_nodes))
        if raw_algorithm not in ("auto", "deepseek"):
            raise KeyError(raw_algorithm)  # SGLang's EplbAlgorithm[...] for a name it does not know
        return raw_algorithm

    hook = plugin.compute_algorithm_hook
    assert hook(sglang_compute_algorithm, raw_algorithm="eplb", num_groups=8, num_nodes=4) is plugin.EPLB
    assert hook(sglang_compute_algorithm, "deepseek", 8, 4) == "deepseek"
    assert calls == [("deepseek", 8, 4)]
    monkeypatch.setenv("EPLB_SGLANG_ALGORITHM", "eplb")
    assert hook(sglang_compute_algorithm, raw_algorithm="auto", num_groups=8, num_nodes=4) is plugin.EPLB


def test_rebalance_hook_leaves_sglangs_algorithms_alone() -> None:
    def sglang_rebalance(*args: Any, **kwargs: Any) -> str:
        return "sglang"

    kwargs: dict[str, Any] = {
        "tokens_per_expert": torch.ones(1, 2, 8), "num_physical_experts": 12, "num_local_physical_experts": 3,
        "num_groups": None, "num_nodes": 1,
    }
    assert plugin.rebalance_experts_hook(sglang_rebalance, **kwargs, algorithm="deepseek") == "sglang"
    phy2log, _, logcnt = plugin.rebalance_experts_hook(sglang_rebalance, **kwargs, algorithm=plugin.EPLB)
    assert phy2log.shape == (2, 12) and (logcnt.sum(dim=1) == 12).all()
    positional = plugin.rebalance_experts_hook(sglang_rebalance, *kwargs.values(), plugin.EPLB)
    assert positional[0].tolist() == phy2log.tolist()


def test_register_without_sglang_is_a_logged_no_op(caplog: pytest.LogCaptureFixture) -> None:
    assert importlib.util.find_spec("sglang") is None
    with caplog.at_level(logging.INFO):
        plugin.register()
    assert "SGLang is not installed" in caplog.text


@pytest.fixture
def sglang_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], dict[str, list[Any]]]]:
    """Modules at SGLang's paths: `eplb_algorithms` with a closed algorithm table, and (optionally) a
    `plugins.hook_registry` whose HookRegistry records registrations and applies AROUND hooks the way
    SGLang documents (wrapper(*a, **k) = hook(original, *a, **k))."""

    def make(with_hooks: bool) -> dict[str, list[Any]]:
        registered: dict[str, list[Any]] = {"hooks": []}
        algorithms = types.ModuleType("sglang.srt.eplb.eplb_algorithms")

        def compute_algorithm(raw_algorithm: str, num_groups: int | None, num_nodes: int) -> str:
            return {"auto": "deepseek", "deepseek": "deepseek"}[raw_algorithm]

        def rebalance_experts(**kwargs: Any) -> str:
            return f"sglang {kwargs['algorithm']}"

        algorithms.compute_algorithm = compute_algorithm  # type: ignore[attr-defined]
        algorithms.rebalance_experts = rebalance_experts  # type: ignore[attr-defined]
        modules = {"sglang": types.ModuleType("sglang"), "sglang.srt.eplb.eplb_algorithms": algorithms}
        modules["sglang"].__path__ = []
        modules["sglang"].__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
        if with_hooks:
            hook_module = types.ModuleType("sglang.srt.plugins.hook_registry")

            class HookType:
                AROUND = "around"

            class HookRegistry:
                @staticmethod
                def register(target: str, hook: Callable[..., Any], hook_type: str) -> None:
                    registered["hooks"].append((target, hook, hook_type))
                    module, name = target.rsplit(".", 1)
                    original = getattr(modules[module], name)
                    setattr(modules[module], name, lambda *a, **k: hook(original, *a, **k))

            hook_module.HookType = HookType  # type: ignore[attr-defined]
            hook_module.HookRegistry = HookRegistry  # type: ignore[attr-defined]
            modules["sglang.srt.plugins.hook_registry"] = hook_module
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return registered

    yield make


def test_register_hooks_the_two_dispatch_functions(sglang_modules: Callable[[bool], dict[str, list[Any]]]) -> None:
    registered = sglang_modules(True)
    plugin.register()
    targets = [(t, kind) for t, _, kind in registered["hooks"]]
    assert targets == [
        ("sglang.srt.eplb.eplb_algorithms.compute_algorithm", "around"),
        ("sglang.srt.eplb.eplb_algorithms.rebalance_experts", "around"),
    ]
    algorithms = sys.modules["sglang.srt.eplb.eplb_algorithms"]
    # SGLang's call sites, as in expert_location.init_by_eplb: keyword arguments, algorithm from the flag
    for flag, expected in (("deepseek", "sglang deepseek"), ("auto", "sglang deepseek")):
        algorithm = algorithms.compute_algorithm(raw_algorithm=flag, num_groups=8, num_nodes=4)
        assert algorithms.rebalance_experts(
            tokens_per_expert=torch.ones(1, 2, 8), num_physical_experts=12, num_local_physical_experts=3,
            num_groups=None, num_nodes=1, algorithm=algorithm,
        ) == expected
    algorithm = algorithms.compute_algorithm(raw_algorithm="eplb", num_groups=None, num_nodes=1)
    phy2log, _, _ = algorithms.rebalance_experts(
        tokens_per_expert=torch.ones(1, 2, 8), num_physical_experts=12, num_local_physical_experts=3,
        num_groups=None, num_nodes=1, algorithm=algorithm,
    )
    assert phy2log.shape == (2, 12)


def test_register_on_sglang_without_plugin_hooks(
    sglang_modules: Callable[[bool], dict[str, list[Any]]], caplog: pytest.LogCaptureFixture
) -> None:
    sglang_modules(False)
    with caplog.at_level(logging.INFO):
        plugin.register()
    assert "no plug-in hooks" in caplog.text and "--init-expert-location" in caplog.text


def test_sglangs_start_checks_the_settings_as_every_rebalance(
    sglang_modules: Callable[[bool], dict[str, list[Any]]], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SGLang's register() checked nothing: a bad EPLB_SGLANG_ALGORITHM was ignored without a word. Now a WARNING
    once (a value no rebalance can use: the next test)."""
    registered = sglang_modules(True)
    monkeypatch.setenv("EPLB_SGLANG_ALGORITHM", "EPLB")
    with caplog.at_level(logging.INFO, logger=plugin.__name__):
        plugin.register()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "eplb plugin: EPLB_SGLANG_ALGORITHM='EPLB' is not 'eplb': --eplb-algorithm alone selects the algorithm"]
    assert len(registered["hooks"]) == 2


def _load_plugins(register: Callable[[], None]) -> None:
    """What SGLang's `execute_plugin_callbacks` (sglang/srt/plugins/__init__.py) does with an entry point: logs what
    it raises and starts without it."""
    try:
        register()
    except Exception:
        logging.getLogger("sglang.srt.plugins").exception("Failed to execute general plugin: eplb")


def test_a_setting_no_rebalance_can_use_stops_sglang_where_it_selects_eplb(
    sglang_modules: Callable[[bool], dict[str, list[Any]]], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """register() raised PolicyInputError for EPLB_MAX_MOVES=99999999999999999999999, which SGLang's load_plugins
    catches and logs: no hook was installed, so with EPLB_SGLANG_ALGORITHM=eplb SGLang ran its own algorithm, and
    --eplb-algorithm eplb was a bare KeyError. Now an ERROR at register, both hooks, and the compute_algorithm hook
    raises the one-line error whenever eplb is selected; SGLang's own names keep working."""
    registered = sglang_modules(True)
    monkeypatch.setenv("EPLB_MAX_MOVES", "99999999999999999999999")
    with caplog.at_level(logging.INFO):
        _load_plugins(plugin.register)
    assert len(registered["hooks"]) == 2 and "Failed to execute" not in caplog.text
    (error,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    with pytest.raises(core.PolicyInputError) as expected:
        core.Settings.from_env()
    message = str(expected.value)
    assert "10,000,000" in message and "\n" not in message
    assert error.startswith(f"eplb plugin: {message}; SGLang stops with this error when it selects the eplb algorithm")
    algorithms = sys.modules["sglang.srt.eplb.eplb_algorithms"]
    assert algorithms.compute_algorithm(raw_algorithm="auto", num_groups=8, num_nodes=4) == "deepseek"
    with pytest.raises(core.PolicyInputError) as raised:
        algorithms.compute_algorithm(raw_algorithm="eplb", num_groups=8, num_nodes=4)
    assert str(raised.value) == message
    monkeypatch.setenv("EPLB_SGLANG_ALGORITHM", "eplb")
    with pytest.raises(core.PolicyInputError) as raised:
        algorithms.compute_algorithm(raw_algorithm="auto", num_groups=8, num_nodes=4)
    assert str(raised.value) == message


@pytest.fixture
def elastic_ep(monkeypatch: pytest.MonkeyPatch) -> Callable[..., types.SimpleNamespace]:
    """SGLang's elastic EP state at its path (`sglang.srt.elastic_ep.elastic_ep`): `ElasticEPStateManager.instance()`
    (current SGLang) or `get_elastic_ep_state()` (older) with `active_ranks`, and an `EplbAlgorithm` enum with
    `elasticity_aware` in `eplb_algorithms`, as SGLang's rebalance_experts reads them."""

    def make(active: list[int] | None, older: bool = False) -> types.SimpleNamespace:
        module = types.ModuleType(plugin.ELASTIC_MODULE)
        state = None if active is None else types.SimpleNamespace(active_ranks=torch.tensor(active, dtype=torch.int32))
        if older:
            module.get_elastic_ep_state = lambda: state  # type: ignore[attr-defined]
        else:
            module.ElasticEPStateManager = types.SimpleNamespace(instance=lambda: state)  # type: ignore[attr-defined]
        algorithms = types.ModuleType(plugin.TARGET_MODULE)
        algorithms.EplbAlgorithm = types.SimpleNamespace(elasticity_aware="EplbAlgorithm.elasticity_aware")  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, plugin.ELASTIC_MODULE, module)
        monkeypatch.setitem(sys.modules, plugin.TARGET_MODULE, algorithms)
        return algorithms.EplbAlgorithm  # type: ignore[no-any-return]

    return make


def test_elastic_ep_keeps_sglangs_elasticity_aware_algorithm(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With EPLB_SGLANG_ALGORITHM=eplb the hook answered eplb's algorithm for every name, elasticity_aware too (what
    SGLang's server args set for "auto" with --elastic-ep-backend), which places experts on failed ranks. Now
    SGLang's, with one WARNING however often SGLang asks."""
    calls: list[str] = []

    def sglang_compute_algorithm(raw_algorithm: str, num_groups: int | None, num_nodes: int) -> str:
        calls.append(raw_algorithm)
        return f"EplbAlgorithm.{raw_algorithm}"

    monkeypatch.setenv("EPLB_SGLANG_ALGORITHM", "eplb")
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        for _ in range(2):
            assert plugin.compute_algorithm_hook(sglang_compute_algorithm, raw_algorithm="elasticity_aware",
                                                 num_groups=8, num_nodes=4) == "EplbAlgorithm.elasticity_aware"
    assert calls == ["elasticity_aware"] * 2
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "eplb algorithm: EPLB_SGLANG_ALGORITHM=eplb is not applied to SGLang's elasticity_aware algorithm (elastic "
        "EP): SGLang's places, as eplb's placement does not leave the slots of failed ranks empty"]
    assert plugin.compute_algorithm_hook(sglang_compute_algorithm, "auto", 8, 4) is plugin.EPLB


@pytest.mark.parametrize("older", [False, True], ids=["ElasticEPStateManager", "get_elastic_ep_state"])
def test_inactive_ranks_get_sglangs_elasticity_aware_placement(
    elastic_ep: Callable[..., Any], older: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The hooks never read SGLang's active ranks, so eplb's placement put experts on dead GPUs. Now, while any rank
    is inactive, SGLang's elasticity_aware algorithm answers eplb's algorithm value (one WARNING per set of ranks),
    called as SGLang called the hook; with every rank active, or no elastic state, eplb places."""
    enum = elastic_ep([1, 0, 1, 0], older)
    seen: list[Any] = []

    def sglang_rebalance(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return "sglang elasticity_aware"

    tokens = torch.ones(1, 2, 8)
    kwargs: dict[str, Any] = {"tokens_per_expert": tokens, "num_physical_experts": 12, "num_local_physical_experts": 3,
                              "num_groups": None, "num_nodes": 1}
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        answer = plugin.rebalance_experts_hook(sglang_rebalance, **kwargs, algorithm=plugin.EPLB)
        assert answer == "sglang elasticity_aware"
        plugin.rebalance_experts_hook(sglang_rebalance, *kwargs.values(), plugin.EPLB)
    assert seen == [((), {**kwargs, "algorithm": enum.elasticity_aware}),
                    ((*kwargs.values(), enum.elasticity_aware), {})]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "eplb algorithm: EP ranks 1,3 of SGLang's elastic EP are inactive: SGLang's elasticity_aware algorithm places, "
        "as eplb's placement does not leave the slots of failed ranks empty"]
    for active in ([1, 1, 1, 1], None):
        elastic_ep(active, older)
        phy2log, _, _ = plugin.rebalance_experts_hook(sglang_rebalance, **kwargs, algorithm=plugin.EPLB)
        assert phy2log.shape == (2, 12) and len(seen) == 2


def test_entry_point_is_installed() -> None:
    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "eplb"]
    assert ep.value == "eplb.integrations.sglang:register" and ep.load() is plugin.register


def test_remote_placement_for_another_cluster_shape_is_not_used(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang passes slots per rank: 16 physical experts of 1 per rank are 16 ranks, which a deployment of 4 GPUs
    x 4 slots does not serve although its map has the same [L, 16] shape; 4 per rank is its shape."""
    import httpx

    base = server_factory()
    remote_mixtral_deployment(base, "sglang-shape", monkeypatch)
    tokens = torch.from_numpy(np.random.default_rng(1).pareto(1.0, size=(2, 4, 8)) * 100)
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        out, _, _ = plugin.rebalance_experts(tokens, 16, 1, None, 1)
    (record,) = [r for r in caplog.records if r.name == plugin.logger.name]
    assert record.levelno == logging.WARNING and "eplb algorithm (local)" in record.message
    assert "num_gpus 4 vs the engine's 16 ranks, slots_per_gpu 4 vs the engine's 1 per rank" in record.message
    monkeypatch.delenv("EPLB_SERVICE_URL")
    assert out.tolist() == plugin.rebalance_experts(tokens, 16, 1, None, 1)[0].tolist()
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        served, _, _ = plugin.rebalance_experts(tokens, 16, 4, None, 1)
    assert "eplb algorithm (remote): placement from" in caplog.text
    assert served.tolist() == httpx.get(f"{base}/deployments/sglang-shape", timeout=60).json()["placement"]["phy2log"]


def test_a_deployment_that_spreads_the_engines_groups_over_nodes_is_warned_about_once(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang asks for 2 groups of 4 experts on 2 nodes of 2 ranks; the deployment (4 GPUs, no nodes) places
    globally: its placement serves, and one WARNING names the cluster fields to set."""
    base = server_factory()
    remote_mixtral_deployment(base, "sglang-groups", monkeypatch)
    tokens = torch.from_numpy(np.random.default_rng(2).pareto(1.0, size=(2, 4, 8)) * 100)
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        out, _, _ = plugin.rebalance_experts(tokens, 16, 4, 2, 2)
        plugin.rebalance_experts(tokens * 2, 16, 4, 2, 2, current_phy2log=out)
    warned = [r for r in caplog.records if "spreads expert groups over nodes" in r.message]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "set the deployment's cluster.gpus_per_node to 2 and cluster.num_groups to 2" in warned[0].message
    assert "eplb algorithm (remote): placement from" in caplog.text


def test_a_refused_remote_placement_leaves_the_serving_map(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The deployment is changed to 2 GPUs x 8 slots under an SGLang of 4 ranks x 4: its placement is refused, the
    serving map (SGLang's current_phy2log) is answered unchanged, and the deployment is not told it was applied."""
    import httpx

    base = server_factory()
    remote_mixtral_deployment(base, "sglang-refused", monkeypatch)
    tokens = torch.from_numpy(np.random.default_rng(3).pareto(1.0, size=(2, 4, 8)) * 100)
    first, _, _ = plugin.rebalance_experts(tokens, 16, 4, None, 1)
    other = {"model": "mixtral-8x7b", "cluster": {"num_gpus": 2, "slots_per_gpu": 8}, "solver": "greedy",
             "policy": {"trigger": "periodic"}}
    assert httpx.put(f"{base}/deployments/sglang-refused", json=other, timeout=60).status_code == 200
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        phy2log, log2phy, logcnt = plugin.rebalance_experts(tokens.flip(2), 16, 4, None, 1, current_phy2log=first)
    (record,) = [r for r in caplog.records if r.name == plugin.logger.name]
    assert record.levelno == logging.WARNING and "eplb algorithm (kept): the serving placement stays" in record.message
    assert phy2log.tolist() == first.tolist()
    assert [t.tolist() for t in core.logical_maps(first.numpy(), 8)] == [log2phy.tolist(), logcnt.tolist()]
    history = httpx.get(f"{base}/deployments/sglang-refused/history", timeout=60).json()["entries"]
    assert "applied" not in [e["action"] for e in history]


def test_every_rank_gets_the_same_remote_map(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's EPLBManager.rebalance runs on every rank with the all-reduced logical counts and the global expert
    location: three ranks calling the plug-in at once with SGLang's map get one map, one window stored."""
    import httpx

    base = server_factory()
    remote_mixtral_deployment(base, "sglang-ranks", monkeypatch)
    monkeypatch.setenv("EPLB_SERVICE_TIMEOUT_S", "60")
    tokens = torch.from_numpy(np.random.default_rng(4).pareto(1.0, size=(2, 4, 8)) * 100)
    serving = torch.from_numpy(np.tile(np.arange(8), (4, 2)))
    maps: list[Any] = [None] * 3
    barrier = threading.Barrier(3)

    def rank(i: int) -> None:
        barrier.wait()
        maps[i] = plugin.rebalance_experts(tokens.clone(), 16, 4, None, 1, current_phy2log=serving.clone())[0]

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert maps[0].tolist() != serving.tolist() and all(m.tolist() == maps[0].tolist() for m in maps)
    deployment = httpx.get(f"{base}/deployments/sglang-ranks", timeout=60).json()
    assert deployment["windows"] == 1 and deployment["placement"]["phy2log"] == maps[0].tolist()
    history = httpx.get(f"{base}/deployments/sglang-ranks/history", timeout=60).json()["entries"]
    assert [e["action"] for e in history] == ["rebalanced", "applied"]


def test_without_sglangs_map_a_fallback_reaches_the_deployment_with_the_next_window(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Outside a running SGLang (no expert location, no current_phy2log) the plug-in passes no map: a local fallback
    (the service behind a proxy answering 503) was never told to the deployment. The next window now carries the map
    the plug-in answered last, which the deployment records first (an `applied` entry) and rebalances from."""
    import httpx

    from eplb import retry
    from tests.flaky_proxy import proxy

    monkeypatch.setattr(retry, "BACKOFF_S", (0.01, 0.01))
    base = server_factory()
    remote_mixtral_deployment(base, "sglang-no-map", monkeypatch)
    rng = np.random.default_rng(5)
    windows = [torch.from_numpy(rng.pareto(1.0, size=(2, 4, 8)) * 100) for _ in range(3)]
    plugin.rebalance_experts(windows[0], 16, 4, None, 1)
    with proxy(base, {1: 503, 2: 503, 3: 503}) as (url, log):
        monkeypatch.setenv("EPLB_SERVICE_URL", url)
        with caplog.at_level(logging.INFO, logger=plugin.logger.name):
            local, _, _ = plugin.rebalance_experts(windows[1], 16, 4, None, 1)
    (record,) = [r for r in caplog.records if r.name == plugin.logger.name]
    assert record.levelno == logging.WARNING and "eplb algorithm (local)" in record.message and len(log) == 3
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    served, _, _ = plugin.rebalance_experts(windows[2], 16, 4, None, 1)
    history = httpx.get(f"{base}/deployments/sglang-no-map/history", timeout=60).json()["entries"]
    assert [e["action"] for e in history] == ["rebalanced", "applied", "placed"]
    assert history[0]["lb_before"] == pytest.approx(
        core.layer_lb(windows[2].sum(dim=0).numpy(), local.numpy(), 4).mean(), abs=1e-5)
    assert served.tolist() == httpx.get(f"{base}/deployments/sglang-no-map", timeout=60).json()["placement"]["phy2log"]


def test_every_sglang_rank_serves_one_map_when_only_some_reach_the_service(
    server_factory: Callable[..., str], tmp_path: Path
) -> None:
    """Four SGLang ranks, real processes in one gloo group (SGLang's world group), rebalance the same windows; rank 0
    cannot reach the service, ranks 1-3 get its answer. Rank 0 served its local solve while the others served the
    service's, and SGLang's expert_location_updater moves weights by each rank's map: now all four serve the service's
    answer, with one log2phy and logcnt."""
    import httpx

    base = server_factory()
    config = {"model": "mixtral-8x7b", "cluster": {"num_gpus": 4, "slots_per_gpu": 4}, "solver": "greedy",
              "policy": {"trigger": "periodic"}}
    assert httpx.put(f"{base}/deployments/sglang-split", json=config, timeout=60).status_code == 201
    windows = np.random.default_rng(14).pareto(1.0, size=(2, 4, 8)) * 100
    current = np.tile(np.arange(8), (4, 2))
    call = {"tokens_per_expert": windows.tolist(), "num_physical_experts": 16, "num_local_physical_experts": 4,
            "num_groups": None, "num_nodes": 1, "current_phy2log": current.tolist()}
    answers = run_ranks("sglang", ["http://127.0.0.1:9", base, base, base], {
        "EPLB_DEPLOYMENT": "sglang-split", "EPLB_SERVICE_TIMEOUT_S": "60"}, call, tmp_path)
    assert all(a["maps"] == answers[1]["maps"] for a in answers), [a["maps"][0] for a in answers]
    deployment = httpx.get(f"{base}/deployments/sglang-split", timeout=60).json()
    assert answers[1]["maps"][0] == deployment["placement"]["phy2log"] != current.tolist()
    ((level, line),) = answers[0]["logs"]
    assert level == "WARNING" and line.startswith("eplb algorithm (rank 1): the map of EP rank 1, which every rank "
                                                  "serves; this rank's own (local): ")
    assert not any(a["forked_group"] for a in answers)


def _dsv3_windows() -> np.ndarray:
    """SGLang's recorded windows for DeepSeek-V3 [W=2, 61 model layers, 256 experts]: its recorder counts no token in
    the dense layers 0-2 (rows of zeros), the MoE layers 3-60 hold the shipped decode window, a quarter and three."""
    windows = np.zeros((2, 61, 256))
    windows[:, 3:] = DECODE[None] * np.array([0.25, 0.75])[:, None, None]
    return windows


def test_a_deepseek_v3_deployment_gets_the_moe_layers_and_its_answer_fills_sglangs_61_rows(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang passes one row per model layer (`ModelConfigForExpertLocation.num_layers` is the model's
    num_hidden_layers), dense ones included: DeepSeek-V3's 61. The plug-in posted all 61 and a deepseek-v3 deployment
    answered 422 (58 MoE layers), so every rebalance fell back to a local solve. Now the 58 rows with tokens go,
    SGLang's map of them labelled with model layers 3-60, and the answer fills SGLang's 61 rows, the dense ones as
    SGLang's own algorithm (DeepSeek's) places a layer of no tokens. A window without tokens is sent nowhere: SGLang's
    map stays."""
    import httpx

    from solvers.greedy import rebalance_experts as deepseek

    base = server_factory()
    config = {"model": "deepseek-v3", "cluster": {"num_gpus": 8, "slots_per_gpu": 36}, "solver": "greedy",
              "policy": {"trigger": "periodic"}}
    assert httpx.put(f"{base}/deployments/sglang-dsv3", json=config, timeout=60).status_code == 201
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    monkeypatch.setenv("EPLB_DEPLOYMENT", "sglang-dsv3")
    monkeypatch.setenv("EPLB_SERVICE_TIMEOUT_S", "60")
    trivial = torch.arange(288).repeat(61, 1) % 256  # SGLang's ExpertLocationMetadata.init_trivial map
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        phy2log, log2phy, logcnt = plugin.rebalance_experts(torch.from_numpy(_dsv3_windows()), 288, 36, 8, 1,
                                                            plugin.EPLB, trivial)
    (record,) = [r for r in caplog.records if r.name == plugin.logger.name]
    assert record.levelno == logging.INFO, record.getMessage()
    assert record.getMessage() == (
        f"eplb algorithm (remote): placement from {base} deployment 'sglang-dsv3'; model layers 3-60 with tokens (58 "
        "MoE layers), 0-2 without (dense: placed as SGLang's deepseek algorithm places a layer of no tokens)")
    deployment = httpx.get(f"{base}/deployments/sglang-dsv3", timeout=60).json()
    assert phy2log.shape == (61, 288) and phy2log[3:].tolist() == deployment["placement"]["phy2log"]
    dense, _, dense_logcnt = deepseek(np.zeros((3, 256)), 288, 8, 1, 8)
    assert phy2log[:3].tolist() == dense.tolist() and logcnt[:3].tolist() == dense_logcnt.tolist()
    assert [t.tolist() for t in core.logical_maps(phy2log.numpy(), 256)] == [log2phy.tolist(), logcnt.tolist()]
    history = httpx.get(f"{base}/deployments/sglang-dsv3/history", timeout=60).json()["entries"]
    assert [(e["action"], e.get("window", {}).get("layers")) for e in history] == [("rebalanced", 58),
                                                                                    ("applied", None)]
    idle, _, _ = plugin.rebalance_experts(torch.zeros(1, 61, 256), 288, 36, 8, 1, plugin.EPLB, phy2log)
    assert idle.tolist() == phy2log.tolist()
    assert httpx.get(f"{base}/deployments/sglang-dsv3", timeout=60).json()["windows"] == 1


def test_sglangs_moe_layers_are_placed_alone_and_its_dense_ones_as_sglang_places_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Locally, DeepSeek's algorithm on SGLang's 61 rows is DeepSeek's answer, exactly (it places each layer on its
    own); with EPLB_SOLVER=greedy the MoE rows are greedy's placement of them alone, where the dense rows were greedy's
    placement of no tokens, and a map is still refused naming SGLang's own row."""
    from solvers.greedy import rebalance_experts as deepseek

    windows = torch.from_numpy(_dsv3_windows())
    out = plugin.rebalance_experts(windows, 288, 36, 8, 1)
    assert [t.tolist() for t in out] == [a.tolist() for a in deepseek(windows.sum(dim=0).numpy(), 288, 8, 1, 8)]
    monkeypatch.setenv("EPLB_SOLVER", "greedy")
    greedy, _, _ = plugin.rebalance_experts(windows, 288, 36, 8, 1)
    assert greedy[3:].tolist() == plugin.rebalance_experts(windows[:, 3:], 288, 36, 8, 1)[0].tolist()
    assert greedy[:3].tolist() == out[0][:3].tolist()
    bad = out[0].clone()
    bad[40, 3] = 999
    with pytest.raises(core.PolicyInputError, match=r"^current_phy2log\[40\]\[3\] is 999: expert ids run 0\.\.255"):
        plugin.rebalance_experts(windows, 288, 36, 8, 1, plugin.EPLB, bad)
