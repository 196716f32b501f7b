"""`eplb solve` / `eplb evaluate` as a user runs them: output, files, and one-line errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.evaluate import balance
from eplb.io.windows import read_window
from eplb.placement import load_placement
from tests.cli_run import error_prefix

ESFT_LAW = Path(__file__).parents[1] / "fixtures" / "esft-dsv2lite-law.json"
ESFT_TOPK = Path(__file__).parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz"


def test_default_job_runs_from_the_console_script(tmp_path: Path) -> None:
    out = tmp_path / "placement.json"
    proc = subprocess.run(["eplb", "solve", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "58 layers x 256 experts" in proc.stdout and "32 GPUs, 9 slots each" in proc.stdout
    placement = load_placement(out)
    lb = balance(read_window(None).loads, placement).lb
    assert f"{lb.max():.3f}" in proc.stdout
    assert lb.max() < 1.05  # real DeepSeek-V3 prefill loads, 32 redundant experts


def test_json_output_is_consistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["solve", "--gpus", "16", "--redundant", "16", "--tokens-per-gpu", "4096", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"placement", "predicted", "solver"}
    assert data["placement"]["slots_per_gpu"] == [17] * 16
    assert len(data["predicted"]["lb"]) == 58 and len(data["predicted"]["time_us"]) == 58
    assert data["predicted"]["baseline"]["lb_max"] > data["predicted"]["lb_max"]
    assert all(b <= lb + 1e-9 for b, lb in zip(data["solver"]["bound"], data["predicted"]["lb"], strict=True))
    assert data["predicted"]["tokens_per_gpu"][0] == 4096


def test_evaluate_reports_the_same_lb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["solve", "--gpus", "8", "--slots-per-gpu", "33", "--out", str(out), "--json"]) == 0
    solved = json.loads(capsys.readouterr().out)
    assert main(["evaluate", "--placement", str(out), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["predicted"]["lb"] == solved["predicted"]["lb"]


def test_hierarchical_and_uneven_budget(capsys: pytest.CaptureFixture[str]) -> None:
    budget = ",".join(["20"] * 16 + ["24"] * 16)
    assert main(["solve", "--memory-budget-gib", budget, "--gpus-per-node", "8", "--groups", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["placement"]["slots_per_gpu"] == [8] * 16 + [10] * 16
    # group-to-node locality: each of the 8 expert groups (32 experts) sits on one node, two groups per node
    phy2log = np.asarray(data["placement"]["phy2log"])
    node_of_slot = np.repeat(np.arange(32) // 8, data["placement"]["slots_per_gpu"])
    for layer in phy2log:
        nodes_of_group = [set(node_of_slot[layer // 32 == group].tolist()) for group in range(8)]
        assert all(len(nodes) == 1 for nodes in nodes_of_group)
        assert sorted(next(iter(nodes)) for nodes in nodes_of_group) == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ('{"loads": [[1, -2]]}', [], "must be >= 0"),
        ('{"loads": [[1, NaN]]}', [], "finite"),
        ('{"loads": [[1, 2], [3]]}', [], "ragged"),
        ('{"loads": [1, 2]}', [], "one row"),
        ("[[1, 2, 3, 4]]", ["--gpus", "2", "--slots-per-gpu", "1"], "cannot hold 4 experts"),
        ("[[1, 2, 3, 4]]", ["--gpus", "2", "--memory-budget-gib", "1"], "needs --model"),
        ("[[1, 2, 3, 4]]", ["--gpus", "2", "--slots-per-gpu", "2", "--current", "nowhere.json"], "not found"),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(tmp_path: Path, content: str, args: list[str], message: str) -> None:
    path = tmp_path / "w.json"
    path.write_text(content)
    proc = subprocess.run(["eplb", "solve", "--loads", str(path), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_one_layer_window_is_one_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    window = tmp_path / "one.json"
    window.write_text('{"loads": [[5, 1, 1, 1]]}')
    assert main(["solve", "--loads", str(window), "--gpus", "2", "--redundant", "0"]) == 0
    assert f"{window}: 1 layer x 4 experts" in capsys.readouterr().out


def test_missing_file_and_budget_too_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["solve", "--loads", "/nonexistent/w.npy"]) == 2
    assert "load file not found: /nonexistent/w.npy" in capsys.readouterr().err
    assert main(["solve", "--memory-budget-gib", "2"]) == 2
    assert "fits no expert" in capsys.readouterr().err


def test_npz_steps_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = np.random.default_rng(0).integers(0, 50, (5, 3, 16))
    np.savez(tmp_path / "log.npz", counts=counts)
    assert main(["solve", "--loads", str(tmp_path / "log.npz"), "--gpus", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["placement"]["phy2log"]) == 3 and "time_us" not in data["predicted"]  # no 16-expert preset


def test_milp_weighted_and_migration_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fixture = Path(__file__).parents[1] / "fixtures" / "esft-dsv2lite-law.json"
    window = {"loads": read_window(fixture).loads[:2].tolist()}
    (tmp_path / "w.json").write_text(json.dumps(window))
    common = ["--loads", str(tmp_path / "w.json"), "--gpus", "8", "--solver", "milp", "--time-limit", "1", "--json"]
    assert main(["solve", *common, "--split", "weighted", "--out", str(tmp_path / "now.json")]) == 0
    weighted = json.loads(capsys.readouterr().out)
    placement = load_placement(tmp_path / "now.json")
    assert placement.shares is not None  # the file carries the shares, validated to sum to 1 per expert
    assert weighted["solver"]["name"] == "milp-weighted"
    drifted = np.asarray(window["loads"]) * np.random.default_rng(0).uniform(0.8, 1.2, (2, 64))
    (tmp_path / "w2.json").write_text(json.dumps({"loads": drifted.tolist()}))
    common[1] = str(tmp_path / "w2.json")
    assert main(["solve", *common, "--current", str(tmp_path / "now.json"), "--max-lb-slack", "0.02"]) == 0
    moved = json.loads(capsys.readouterr().out)
    assert moved["moves"]["total"] == sum(moved["moves"]["per_layer"]) >= 0
    assert moved["moves"]["bytes_moved"] == pytest.approx(moved["moves"]["total"] * 3 * 2048 * 1408 * 2)
    assert main(["solve", *common, "--max-lb-slack", "3"]) == 2
    assert "--max-lb-slack must be between 0 and 1" in capsys.readouterr().err


def test_a_uniform_split_with_the_weighted_milp_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--solver milp-weighted --split uniform` wrote weighted shares: --split uniform, the default, was not told
    from one not given, and milp-weighted names its split itself."""
    out = tmp_path / "mw.json"
    err = _error(capsys, "--loads", str(ESFT_LAW), "--gpus", "8", "--solver", "milp-weighted", "--split", "uniform",
                 "--out", str(out))
    assert err == ("eplb solve: error: --solver milp-weighted gives replicas weighted shares, --split uniform even "
                   "ones: drop --split uniform, or choose --solver milp")
    assert not out.exists()
    # --split given alone, or agreeing with the solver, still runs
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": read_window(ESFT_LAW).loads[:1].tolist()}))
    for argv in (["--split", "uniform"], ["--solver", "milp", "--split", "uniform", "--time-limit", "1"],
                 ["--solver", "milp-weighted", "--split", "weighted", "--time-limit", "1"]):
        assert main(["solve", "--loads", str(window), "--gpus", "8", "--json", *argv]) == 0, argv
        shares = json.loads(capsys.readouterr().out)["placement"].get("shares")
        assert (shares is not None) == ("weighted" in argv), argv


def test_current_placement_gives_the_cluster_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--current without --gpus or a slot flag solves for the current placement's GPUs and slots (not the default
    32 GPUs x 9 slots, which were then refused as another cluster); flags that ask for another shape are refused,
    one line naming both."""
    out = tmp_path / "p64.json"
    assert main(["solve", "--gpus", "64", "--redundant", "64", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["solve", "--current", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["placement"]["slots_per_gpu"] == [5] * 64
    for agreeing in (["--gpus", "64"], ["--slots-per-gpu", "5"], ["--gpus", "64", "--redundant", "64"],
                     ["--gpus-per-node", "8", "--groups", "8"]):
        assert main(["solve", "--current", str(out), *agreeing, "--json"]) == 0, agreeing
        assert json.loads(capsys.readouterr().out)["placement"]["slots_per_gpu"] == [5] * 64, agreeing
    err = _error(capsys, "--gpus", "32", "--current", str(out))
    assert f"--gpus 32: {out} records its own GPU count, 64: give 64" in err
    err = _error(capsys, "--redundant", "128", "--current", str(out))
    assert (f"--redundant 128 asks for 64 GPUs, 6 slots each, but --current {out} is for 64 GPUs, 5 slots each"
            in err)
    err = _error(capsys, "--slots-per-gpu", "6", "--current", str(out))
    assert f"--slots-per-gpu 6 asks for 64 GPUs, 6 slots each, but --current {out} is for 64 GPUs, 5 slots each" in err
    sglang = tmp_path / "sglang.json"  # records no GPU count: --gpus splits it, as evaluate and export
    assert main(["export", "--placement", str(out), "--to", "sglang", "--out", str(sglang)]) == 0
    assert _error(capsys, "--current", str(sglang)).endswith(
        "SGLang placement files do not record the EP size; pass the GPU count (--gpus)")
    assert main(["solve", "--current", str(sglang), "--gpus", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["placement"]["slots_per_gpu"] == [5] * 64


def test_zero_gpus_per_node_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for link in ("nvlink", "nvlink+nic"):
        assert main(["solve", "--gpus", "32", "--gpus-per-node", "0", "--link", link]) == 2
        assert "32 GPUs do not split into nodes of 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A placement of the embedded DeepSeek-V3 window on the default 32 GPUs, to rebalance from."""
    out = tmp_path_factory.mktemp("serving") / "p.json"
    assert main(["solve", "--out", str(out)]) == 0
    return out


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one error line of an `eplb solve` run that must fail with exit 2."""
    capsys.readouterr()
    assert main(["solve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err.strip()


@pytest.mark.parametrize("extra, named", [
    (["--plan", "pl.json"], "--plan"),
    (["--out", "o.json", "--stage-gib", "1"], "--out, --stage-gib"),
    (["--solver", "milp", "--time-limit", "1"], "--solver, --time-limit"),
    (["--max-moves", "10", "--target-lb", "1.01"], "--max-moves, --target-lb"),
])
def test_frontier_refuses_the_flags_it_would_ignore(
    serving: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    """--frontier prints a curve: a plan or placement asked for beside it was silently never written."""
    extra = [str(tmp_path / a) if a.endswith(".json") else a for a in extra]
    err = _error(capsys, "--current", str(serving), "--frontier", *extra)
    assert err.startswith("eplb solve: error: --frontier prints the copies-vs-lb curve") and f"drop {named} (" in err
    assert not list(tmp_path.iterdir())
    assert main(["solve", "--current", str(serving), "--frontier", "--solver", "incremental", "--json"]) == 0


def test_move_budgets_and_stage_sizes_are_refused_in_the_flags_terms(
    serving: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, "--max-moves", "10")
    assert err == ("eplb solve: error: --max-moves: a move budget bounds the edits of the serving placement: give it "
                   "with --current FILE")
    # --target-lb is no move budget (it was called one): it says where the edits may stop
    assert _error(capsys, "--target-lb", "1.05") == ("eplb solve: error: --target-lb: a target lb bounds the edits of "
                                                     "the serving placement: give it with --current FILE")
    assert "--max-moves-per-layer, --target-lb: a move budget and a target lb bound the edits" in _error(
        capsys, "--max-moves-per-layer", "2", "--target-lb", "1.01")
    assert "--max-moves, --max-moves-per-layer: move budgets bound the edits" in _error(
        capsys, "--max-moves", "3", "--max-moves-per-layer", "2")
    # the registry's 'give the current placement' named no flag
    from solvers import registry

    assert _error(capsys, "--solver", "incremental") == (
        "eplb solve: error: solver 'incremental' rebalances a serving placement: give it with --current FILE (or a "
        f"solver that places from scratch: {', '.join(n for n in registry.names() if n != 'incremental')})")
    # one DeepSeek-V3 expert in one layer: 3 matrices of 7168 x 2048 FP8 bytes = 0.041 GiB
    assert _error(capsys, "--current", str(serving), "--stage-gib", "0.01") == (
        "eplb solve: error: --stage-gib 0.01: a stage must hold one expert copy of deepseek-v3, at least 0.0411 GiB")
    assert main(["solve", "--current", str(serving), "--stage-gib", "0.0411", "--json"]) == 0  # the minimum shown


def test_stage_gib_without_a_model_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": [[1, 2, 3, 4]]}))  # no preset has 4 experts
    base = ["--loads", str(window), "--gpus", "2"]
    assert main(["solve", *base, "--out", str(tmp_path / "p.json")]) == 0
    err = _error(capsys, *base, "--current", str(tmp_path / "p.json"), "--stage-gib", "1")
    assert "--stage-gib needs --model" in err and "no preset matches the loads' 4 experts and layers" in err


def test_a_window_of_more_layers_than_its_model_has_is_refused_naming_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eplb solve --model deepseek-v3` took a 59-layer window (it judged the experts only) and wrote a placement
    `eplb export --to sglang` made 59 rows of, while POST /placement refused the window. One rule now
    (`ModelSpec.window_mismatch`) for `eplb solve`, `eplb evaluate`, `eplb compare` and the service: the same text,
    then each one's way out (the CLI's flags, the service's rows); nothing written. 58 layers, a part of the model
    or `eplb compare --layers 58`, are taken."""
    from api.convert import model_for
    from eplb.errors import FieldError
    from eplb.specs import MODEL_PRESETS

    loads = np.random.default_rng(0).integers(1, 100, (59, 256)).astype(float)
    window, out = tmp_path / "w59.npy", tmp_path / "p.json"
    np.save(window, loads)
    rule = "59 layers, but model 'deepseek-v3' has 58 MoE layers (61 layers, the first 3 dense)"
    assert MODEL_PRESETS["deepseek-v3"].window_mismatch(59, 256, "the loads have") == f"the loads have {rule}"
    way = ("give --model a model with 256 experts and 59 or more MoE layers, a preset or a JSON file; or --loads with "
           "one row per MoE layer, at most 58 (fewer are a part of the model), of its 256 experts; or drop --model")
    assert main(["solve", "--loads", str(window), "--model", "deepseek-v3", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"eplb solve: error: the loads have {rule}: {way}\n"
    assert not out.exists()
    assert main(["solve", "--loads", str(window), "--out", str(out), "--json"]) == 0  # no preset fits 59 layers
    assert "time_us" not in json.loads(capsys.readouterr().out)["predicted"] and load_placement(out).num_layers == 59
    assert main(["evaluate", "--loads", str(window), "--placement", str(out), "--model", "DeepSeek-V3"]) == 2
    assert capsys.readouterr().err == f"eplb evaluate: error: the loads have {rule}: {way}\n"
    with pytest.raises(FieldError) as caught:  # POST /placement and a deployment's windows
        model_for("deepseek-v3", loads)
    assert (caught.value.fields, caught.value.message) == (("loads",), f"the window has {rule}: send one row per MoE "
                                                           "layer, at most 58 (fewer are a part of the model), of its "
                                                           "256 experts")  # fmt: skip
    compare = ["compare", "--loads", str(window), "--model", "deepseek-v3", "--solvers", "greedy", "--ep", "32",
               "--out", str(tmp_path / "report")]  # fmt: skip
    assert main(compare) == 2
    assert capsys.readouterr().err == f"eplb compare: error: the loads have {rule}: {way}\n"
    assert main([*compare, "--layers", "58"]) == 0  # the layers it compares are a part of the model
    assert "wrote " in capsys.readouterr().out
    assert "deepseek-v3" in json.loads((tmp_path / "report" / "results.json").read_text())["meta"]["model"]
    np.save(window, loads[:58])
    assert main(["solve", "--loads", str(window), "--model", "deepseek-v3", "--out", str(out), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["predicted"]["time_us"]) == 58


def test_the_cli_and_the_service_bound_gpus_each_by_its_own_named_limit(capsys: pytest.CaptureFixture[str]) -> None:
    """Two limits were both called MAX_GPUS (4,096 in eplb.rules, 65,536 in eplb.cli.solve): the service's
    (SERVICE_MAX_GPUS) bounds a request's work, which shares its workers; the CLI's (CLI_MAX_GPUS) only what the C
    kernels and numpy are given, a local run's time being its user's. Each is what its side refuses above."""
    from pydantic import ValidationError

    from api.schemas import ClusterIn
    from eplb.cli import build_parser
    from eplb.cli.solve import CLI_MAX_GPUS
    from eplb.rules import SERVICE_MAX_GPUS

    assert (SERVICE_MAX_GPUS, CLI_MAX_GPUS) == (4096, 65_536)
    assert ClusterIn.model_validate({"num_gpus": SERVICE_MAX_GPUS}).num_gpus == SERVICE_MAX_GPUS
    with pytest.raises(ValidationError, match="less than or equal to 4096"):
        ClusterIn.model_validate({"num_gpus": SERVICE_MAX_GPUS + 1})
    for command in (["solve", "--gpus"], ["evaluate", "--loads", "w.json", "--placement", "p.json", "--gpus"]):
        parsed = build_parser(command).parse_args([*command, str(SERVICE_MAX_GPUS + 1)])
        assert parsed.gpus == SERVICE_MAX_GPUS + 1  # the CLI takes more than the service
        with pytest.raises(SystemExit) as refused:  # argparse's type error: one line
            main([*command, str(CLI_MAX_GPUS + 1)])
        assert refused.value.code == 2
        assert f"argument --gpus: {CLI_MAX_GPUS + 1} is too large (at most 65,536 GPUs)" in capsys.readouterr().err
    assert main(["compare", "--ep", str(CLI_MAX_GPUS + 1), "--out", "never"]) == 2
    assert "--ep takes comma-separated whole numbers of GPUs, 1 to 65,536" in capsys.readouterr().err


@pytest.mark.parametrize("argv, solver", [
    (["--time-limit", "3", "--solver", "greedy"], "greedy"),
    (["--time-limit", "3"], "greedy"),
    (["--total-time-limit", "3", "--solver", "deepseek"], "deepseek"),
    (["--time-limit", "3", "--current", "CURRENT"], "incremental"),
])
def test_time_limits_are_refused_for_solvers_without_one(
    serving: Path, capsys: pytest.CaptureFixture[str], argv: list[str], solver: str
) -> None:
    """As --max-lb-slack is for solvers that do not take it: a time limit was silently dropped."""
    err = _error(capsys, *[str(serving) if a == "CURRENT" else a for a in argv])
    assert err.startswith(f"eplb solve: error: solver {solver!r} does not take --") and "(milp, milp-weighted)" in err
    assert "(it has no time limit)" in err
    err = _error(capsys, "--solver", "milp", "--time-limit", "inf")
    assert "--time-limit must be > 0 seconds and finite, got inf" in err


@pytest.mark.parametrize("argv, said", [
    (["--solver", "greedy", "--max-moves", "5"], "solver 'greedy' does not take --max-moves (it takes: none)"),
    (["--solver", "deepseek", "--max-lb-slack", "0.2"], "solver 'deepseek' does not take --max-lb-slack"),
    (["--solver", "greedy", "--target-lb", "1.1", "--max-moves-per-layer", "2"],
     "solver 'greedy' does not take --max-moves-per-layer, --target-lb (it takes: none)"),
    (["--solver", "milp", "--max-moves", "5", "--time-limit", "1"],
     "solver 'milp' does not take --max-moves (it takes: --max-lb-slack, --time-limit, --total-time-limit)"),
    (["--target-lb", "0.5"], "--target-lb must be >= 1 (lb = busiest GPU / mean GPU), got 0.5"),
    (["--max-moves", "-1"], "--max-moves must be >= 0, got -1"),
])
def test_options_a_solver_refuses_are_named_by_their_flags(
    serving: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """The registry named the options (`max_lb_slack`), not the flags the user typed; `OPTION_FLAGS` is the one
    mapping. The Python API (and the service's JSON fields) keep the option names. The MILP is refused before
    it starts (its 'solving ...' line came first)."""
    from solvers.registry import Options

    err = _error(capsys, "--current", str(serving), *argv)
    assert err.startswith("eplb solve: error: ") and said in err, err
    assert not [option for option in Options.__dataclass_fields__ if option in err], err


def test_the_registry_names_options_by_the_names_given() -> None:
    from eplb.cli.solve import OPTION_FLAGS
    from solvers import registry
    from solvers.registry import Options

    with pytest.raises(registry.SolverError, match=r"solver 'greedy' does not take max_lb_slack \(it takes: none\)"):
        registry.check_options("greedy", Options(max_lb_slack=0.2), has_current=True)
    with pytest.raises(registry.SolverError, match=r"does not take --max-lb-slack \(it takes: none\)"):
        registry.check_options("greedy", Options(max_lb_slack=0.2), has_current=True, names=OPTION_FLAGS)
    with pytest.raises(registry.SolverError, match=r"^--max-moves: a move budget needs the serving placement"):
        registry.check_options("greedy", Options(max_moves=3), has_current=False, names=OPTION_FLAGS)
    assert set(OPTION_FLAGS) == set(Options.__dataclass_fields__)  # every option has its flag


@pytest.mark.parametrize("target", ["sglang", "trtllm"])
def test_evaluate_takes_sglang_and_trtllm_placements_with_gpus(
    serving: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    """Their files do not record the EP size: evaluate said 'pass the GPU count (--gpus)' but had no --gpus."""
    foreign = tmp_path / f"placement.{target}.{'json' if target == 'sglang' else 'yaml'}"
    assert main(["export", "--placement", str(serving), "--to", target, "--out", str(foreign)]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--placement", str(serving), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert main(["evaluate", "--placement", str(foreign), "--gpus", "32", "--json"]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert theirs["predicted"]["lb"] == ours["predicted"]["lb"]
    assert theirs["placement"]["phy2log"] == ours["placement"]["phy2log"]
    capsys.readouterr()
    assert main(["evaluate", "--placement", str(foreign)]) == 2
    assert "do not record the EP size; pass the GPU count (--gpus)" in capsys.readouterr().err
    assert main(["evaluate", "--placement", str(foreign), "--gpus", "7"]) == 2
    assert "288 slots per layer do not split evenly over 7 GPUs" in capsys.readouterr().err


def test_a_gpu_count_against_a_placement_that_records_its_own_is_refused(
    serving: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`export --gpus 7` on an eplb placement of 32 GPUs was silently ignored (and so would evaluate's be)."""
    said = (f"--gpus 7: {serving} records its own GPU count, 32: give 32, or a placement for 7 GPUs (only SGLang "
            "and TensorRT-LLM files, which do not record it, need --gpus to be read)")
    out = tmp_path / "p.json"
    for argv in (["export", "--placement", str(serving), "--to", "json", "--out", str(out), "--gpus", "7"],
                 ["evaluate", "--placement", str(serving), "--gpus", "7"]):
        capsys.readouterr()
        assert main(argv) == 2
        assert capsys.readouterr().err == error_prefix(argv) + f"{said}\n"
    assert not out.exists()
    assert main(["export", "--placement", str(serving), "--to", "json", "--out", str(out), "--gpus", "32"]) == 0


def test_long_options_are_never_abbreviated(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's prefix matching read `--gpus 32` as `--gpus-per-node 32` where a command has no --gpus, and
    `--gpus-per 8` as --gpus-per-node; every parser and subparser of the CLI refuses prefixes."""
    from eplb.cli import build_parser

    for argv in (["solve", "--gpus-per", "8"], ["solve", "--slots", "9"], ["replay", "log.npz", "--inter", "5"],
                 ["logs", "convert", "a.npz", "b.npz", "--shard", "5"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert f"unrecognized arguments: {argv[-2]} {argv[-1]}" in capsys.readouterr().err

    def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return [parser, *(q for s in subs for p in s.choices.values() for q in parsers(p))]

    every = parsers(build_parser())
    assert len(every) > 15 and all(not p.allow_abbrev for p in every)


@pytest.mark.parametrize(("argv", "usage", "said"), [
    (["solve", "--gpu", "32"], "eplb solve", "--gpu 32 (did you mean --gpus?)"),
    (["solve", "--gpu=32", "--redundent", "3"], "eplb solve",
     "--gpu=32 --redundent 3 (did you mean --gpus for --gpu, --redundant for --redundent?)"),
    (["solve", "--xyz", "3"], "eplb solve", "--xyz 3"),
    (["replay", "log.npz", "--inter", "5"], "eplb replay", "--inter 5 (did you mean --interval?)"),
    (["logs", "convert", "a.npz", "b.npz", "--shard", "5"], "eplb logs convert",
     "--shard 5 (did you mean --shard-steps?)"),
    # a flag the word begins comes first: --slots was offered --split, a closer spelling with the dashes counted
    (["solve", "--slots", "3"], "eplb solve", "--slots 3 (did you mean --slots-per-gpu?)"),
    (["solve", "--gpus-per-nodes", "8"], "eplb solve", "--gpus-per-nodes 8 (did you mean --gpus-per-node?)"),
    (["solve", "--max", "3"], "eplb solve", "--max 3 (did you mean --max-moves?)"),
    # replay's EP size is --gpus (--ep was offered --help), compare's --ep
    (["replay", "log.npz", "--ep", "8"], "eplb replay", "--ep 8 (did you mean --gpus?)"),
    (["compare", "--out", "r", "--gpus", "8"], "eplb compare", "--gpus 8 (did you mean --ep?)"),
])  # fmt: skip
def test_a_mistyped_flag_is_the_subcommands_error_with_the_nearest_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], usage: str, said: str
) -> None:
    """`eplb solve --gpu 32` was refused by the top-level parser: 'usage: eplb [-h] COMMAND ...', 'eplb: error:
    unrecognized arguments: --gpu 32', naming neither the command nor the flag meant."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} [-h]") and err.endswith(f"\n{usage}: error: unrecognized arguments: "
                                                                    f"{said}\n"), err


def _help(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """`eplb COMMAND --help`, its words joined by single spaces (argparse wraps them to the terminal: to COLUMNS)."""
    with pytest.MonkeyPatch.context() as env, pytest.raises(SystemExit) as info:
        env.setenv("COLUMNS", "10000")  # no line breaks inside hyphenated words
        main([command, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_the_help_describes_every_solver_and_what_each_command_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """solve --help's --solver described greedy, milp and incremental only (its own words, which drift from the
    registry's); --memory-budget-gib said it needs --model, though it takes the preset of the window's expert
    count; compare --help's --link offered nvlink+nic with --gpus-per-node, which compare has not (and refuses
    '+' links)."""
    from solvers import registry

    text = _help(capsys, "solve")
    for name in registry.names():
        assert f"{name}: {' '.join(registry.get_solver(name).summary.split())}" in text, name
    assert "needs the model (--model)" not in text and "a slot holds one expert of the model (--model, or its " \
        "default) in every MoE layer" in text
    assert main(["solve", "--memory-budget-gib", "22", "--json"]) == 0  # no --model: deepseek-v3, by 256 experts
    assert json.loads(capsys.readouterr().out)["placement"]["slots_per_gpu"] == [9] * 32
    text = _help(capsys, "compare")
    assert "--gpus-per-node" not in text and "nvlink+nic" not in text and "one link (no '+'" in text
    assert "nvlink+nic is DeepEP's dispatch" in _help(capsys, "replay")  # replay has --gpus-per-node


def test_building_the_solve_parser_imports_no_solver() -> None:
    """--solver's help reads the summaries from the solver classes only when it is shown: importing them all
    (the MILP's OR-Tools) would cost every start-up 0.3 s."""
    code = ("import sys; from eplb.cli import build_parser; build_parser(['solve']).parse_args(['solve', '--solver', "
            "'milp']); print(sorted(m for m in sys.modules if m.startswith(('solvers.milp', 'ortools'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"


def test_the_milp_refusing_groups_with_a_current_placement_says_what_to_drop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal said '(greedy, deepseek, incremental do both)', but greedy and deepseek do not minimize copies
    from a current placement, and it no longer said which flags to drop (the MILP's own message did). The list
    comes from the capabilities; the solver it names takes the same command."""
    hierarchy = ["--gpus", "32", "--gpus-per-node", "8", "--groups", "8"]
    current = tmp_path / "p.json"
    assert main(["solve", *hierarchy, "--out", str(current)]) == 0
    capsys.readouterr()
    err = _error(capsys, *hierarchy, "--current", str(current), "--solver", "milp")  # no 'solving ...' line first
    assert err == ("eplb solve: error: solver 'milp' keeps expert groups within nodes or minimizes copies from a "
                   "current placement, not both: drop --groups/--gpus-per-node or --current, or choose a solver "
                   "that does both (incremental)")
    assert main(["solve", *hierarchy, "--current", str(current), "--solver", "incremental", "--json"]) == 0


def test_the_solvers_said_to_do_both_keep_groups_and_take_the_current_placement() -> None:
    """Built from the capabilities; the hint names what the caller's names call the groups and the current
    placement, and offers no dropping of the current placement when the names do not name it (a deployment)."""
    from solvers import registry
    from solvers.registry import Options, Problem

    both = [n for n in registry.names() if (c := registry.get_solver(n).capabilities).hierarchical
            and c.hierarchical_with_current and c.current]
    assert both == ["incremental"]
    assert not registry.get_solver("greedy").capabilities.current  # it was listed
    problem = Problem(np.ones((1, 64)), np.full(8, 9, dtype=np.int64), num_groups=8, gpus_per_node=4,
                      current_phy2log=np.zeros((1, 72), dtype=np.int64))
    fields = {"num_groups": "cluster.num_groups", "gpus_per_node": "cluster.gpus_per_node",
              "current_phy2log": "current_placement"}
    with pytest.raises(registry.SolverError, match=r"not both: drop cluster.num_groups/cluster.gpus_per_node or "
                       r"current_placement, or choose a solver that does both \(incremental\)$"):
        registry.check("milp", problem, Options(), names=fields)
    del fields["current_phy2log"]
    with pytest.raises(registry.SolverError, match=r"not both: drop cluster.num_groups/cluster.gpus_per_node, or "
                       r"choose a solver that does both \(incremental\)$"):
        registry.check("milp-weighted", problem, Options(), names=fields)


@pytest.mark.parametrize("argv, said", [
    (["--solver", "milp", "--gpus-per-node", "8", "--groups", "8", "--current", "CURRENT"],
     "solver 'milp' keeps expert groups within nodes or minimizes copies from a current placement, not both"),
    (["--solver", "milp", "--split", "weighted", "--objective", "time", "--model", "deepseek-v3"],
     "the time objective places uniform shares: drop --split weighted (solver 'milp-weighted')"),
    (["--solver", "milp-weighted", "--objective", "time", "--model", "deepseek-v3"],
     "the time objective places uniform shares, and solver 'milp-weighted' weights them"),
    (["--solver", "milp", "--link", "bogus"], "--link bogus: link must be"),
    (["--solver", "milp", "--hardware", "nope"], "unknown hardware 'nope'"),
    (["--solver", "milp", "--gpus-per-node", "3"], "32 GPUs do not split into nodes of 3"),
    (["--solver", "milp", "--loads", "TOPK", "--coactivation", "TOPK", "--node-limit", "2"],
     "a node limit caps the nodes a token reaches"),
    (["--solver", "milp", "--node-limit", "2"], "--node-limit caps the nodes a token reaches"),
    (["--solver", "milp", "--coactivation", "MISSING"], "co-activation file not found"),
])  # fmt: skip
def test_the_milp_refuses_before_its_progress_line(
    serving: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """The 'solving N layers with the MILP ...' line came before these refusals (solve's checks, the registry's,
    the cost and co-activation setup): now `solve` calls it back once every input is checked."""
    swap = {"CURRENT": str(serving), "MISSING": str(tmp_path / "missing.json"), "TOPK": str(ESFT_TOPK)}
    err = _error(capsys, *[swap.get(a, a) for a in argv])  # the one line: the error, no progress before it
    assert err.startswith(f"eplb solve: error: {said}"), err


def test_the_milp_progress_line_comes_before_a_solve_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check above can fail: the line is still printed, first, for both MILP solvers that do run."""
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": read_window(None).loads[:1].tolist()}))
    for solver in ("milp", "milp-weighted"):
        capsys.readouterr()
        assert main(["solve", "--loads", str(window), "--solver", solver, "--time-limit", "0.05", "--json"]) == 0
        out, err = capsys.readouterr()
        assert err.startswith("solving 1 layers with the MILP, up to 0.05 s per layer on ") and err.count("\n") == 1
        assert json.loads(out)["solver"]["name"] == solver


def test_a_layer_without_tokens_counts_in_no_mean_of_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A layer of all-zero loads has no lb: the printed lb mean and lb max, the lower bound's and the worst
    layers are over the layers with tokens, as --json's lb_mean says (it printed 1.417 where --json said 1.833:
    the empty layer counted as 1.0)."""
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": [[90, 5, 3, 2, 0, 0, 0, 0], [0] * 8]}))
    args = ["--loads", str(window), "--gpus", "2", "--slots-per-gpu", "4", "--solver", "greedy"]
    for command in ("solve", "evaluate"):
        if command == "evaluate":
            extra = ["--placement", str(tmp_path / "p.json")]
            common = [a for a in args if a not in ("--solver", "greedy", "--slots-per-gpu", "4")]
        else:
            extra, common = ["--out", str(tmp_path / "p.json")], args
        assert main([command, *common, *extra, "--json"]) == 0
        predicted = json.loads(capsys.readouterr().out)["predicted"]
        assert predicted["lb"][1] is None and predicted["lb_mean"] == predicted["lb_max"] == predicted["lb"][0] > 1.2
        assert main([command, *common, *extra]) == 0
        printed = capsys.readouterr().out
        rows = {line.split()[0]: line.split()[-3:] for line in printed.splitlines() if line.startswith("  ")}
        base = predicted["baseline"]
        assert rows["placement"][:2] == [f"{predicted['lb_mean']:.3f}", f"{predicted['lb_max']:.3f}"]
        assert rows["baseline"][:2] == [f"{base['lb_mean']:.3f}", f"{base['lb_max']:.3f}"]
        assert "(1 layer of 2 without tokens: no lb, left out of the above)" in printed
        assert "worst layers: 0: lb" in printed and "; 1: lb" not in printed
        if command == "solve":  # the bound of the layer with tokens only: its 1.0 would have made the mean lower
            bound = rows["lower"]
            assert bound[-2:] == [f"{90 / 50:.3f}"] * 2, printed  # one 90-token expert, 2 GPUs' mean of 50
    (tmp_path / "z.json").write_text(json.dumps({"loads": [[0] * 8] * 2}))
    assert main(["solve", "--loads", str(tmp_path / "z.json"), "--gpus", "2", "--slots-per-gpu", "4"]) == 0
    printed = capsys.readouterr().out
    assert "  placement                     n/a      n/a               n/a" in printed and "worst layers" not in printed


def test_one_gpu_and_one_slot_are_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cluster line counts in words (eplb.io.files.plural): '1 GPU', '1 slot' (it said '1 GPUs')."""
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": [[5, 3, 2, 1]]}))
    assert main(["solve", "--loads", str(window), "--gpus", "1", "--slots-per-gpu", "4"]) == 0
    assert "cluster:    1 GPU, 4 slots each, 4 slots per layer (0 redundant)" in capsys.readouterr().out
    assert main(["solve", "--loads", str(window), "--gpus", "4", "--slots-per-gpu", "1"]) == 0
    assert "cluster:    4 GPUs, 1 slot each" in capsys.readouterr().out


def test_the_summary_says_which_policy_placed_the_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The text output never said whether the hierarchical policy ran (--groups 4 on 8 nodes fell back to the global
    placement silently; a note at the end came later, and nothing said when it did run): one `policy:` line after the
    solver's says which ran and, when --groups with --gpus-per-node asked for the hierarchical one, why it did not."""
    common = ["solve", "--gpus", "64", "--gpus-per-node", "8", "--redundant", "64"]

    def policy(*argv: str) -> str:
        assert main(list(argv)) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[2].startswith("solver:     ") and sum(line.startswith("policy:") for line in lines) == 1
        return lines[3]

    assert policy(*common, "--groups", "4") == (
        "policy:     global, not hierarchical (--groups 4 --gpus-per-node 8): 4 groups do not divide evenly over the 8 "
        "nodes (64 GPUs / 8 per node): give a multiple of 8 groups")
    assert policy(*common, "--groups", "8") == (
        "policy:     hierarchical: 8 expert groups kept within the 8 nodes of 8 GPUs")
    assert policy("solve", "--gpus", "8", "--gpus-per-node", "8", "--groups", "8") == (
        "policy:     global, not hierarchical (--groups 8 --gpus-per-node 8): the 8 GPUs are one node of 8, so there "
        "is no node to keep a group within")
    assert policy("solve", "--gpus", "64", "--out", str(tmp_path / "p.json")) == (
        "policy:     global: experts placed over all 64 GPUs (the hierarchical policy, expert groups kept within "
        "nodes, needs --groups with --gpus-per-node)")
    assert policy("solve", "--current", str(tmp_path / "p.json"), "--gpus-per-node", "8", "--groups", "8").startswith(
        "policy:     hierarchical edits: an expert moves only onto the nodes of 8 GPUs where --current holds its group")


def test_a_node_limit_without_coactivation_is_refused_naming_both_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--node-limit caps only the copies per token counted from a co-activation summary: without --coactivation
    `eplb solve` and `eplb evaluate` ran and exited 0, the limit read by nothing (the API's 422 names node_limit
    and coactivation). Refused before any file is read; with --coactivation it is taken."""
    placement = tmp_path / "p.json"
    said = ("--node-limit caps the nodes a token reaches, counted from the window's co-activation summary: give "
            "--coactivation FILE (a summary or a token-level log, docs/formats.md) or drop --node-limit")
    for command, extra in (("solve", ["--out", str(placement)]), ("evaluate", ["--placement", str(placement)])):
        capsys.readouterr()
        assert main([command, "--gpus-per-node", "4", "--node-limit", "1", *extra]) == 2
        err = capsys.readouterr().err
        assert err == f"eplb {command}: error: {said}\n"
        assert not placement.exists()  # nothing solved: evaluate refused before reading the missing placement
    taken = ["--loads", str(ESFT_TOPK), "--coactivation", str(ESFT_TOPK), "--gpus-per-node", "4", "--node-limit",
             "1", "--json"]
    assert main(["solve", *taken, "--gpus", "8", "--out", str(placement)]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["copies_per_token"]
    assert main(["evaluate", *taken, "--placement", str(placement)]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["copies_per_token"]
