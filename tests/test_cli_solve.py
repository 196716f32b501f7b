"""`eplb solve` / `eplb evaluate` as a user runs them: output, files, and one-line errors."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.evaluate import balance
from eplb.io.windows import read_window
from eplb.placement import load_placement


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


def test_current_placement_of_another_cluster_is_one_short_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p64.json"
    assert main(["solve", "--gpus", "64", "--redundant", "64", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["solve", "--gpus", "32", "--current", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is for 64 GPUs, 5 slots each, the request asks for 32 GPUs, 9 slots each" in err and len(err) < 200


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
    assert err == ("eplb solve: error: --max-moves: a move budget edits the serving placement: give it with "
                   "--current FILE")
    assert "--max-moves-per-layer, --target-lb: a move budget" in _error(capsys, "--max-moves-per-layer", "2",
                                                                          "--target-lb", "1.01")
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


def test_one_gpu_and_one_slot_are_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cluster line counts in words (eplb.io.files.plural): '1 GPU', '1 slot' (it said '1 GPUs')."""
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": [[5, 3, 2, 1]]}))
    assert main(["solve", "--loads", str(window), "--gpus", "1", "--slots-per-gpu", "4"]) == 0
    assert "cluster:    1 GPU, 4 slots each, 4 slots per layer (0 redundant)" in capsys.readouterr().out
    assert main(["solve", "--loads", str(window), "--gpus", "4", "--slots-per-gpu", "1"]) == 0
    assert "cluster:    4 GPUs, 1 slot each" in capsys.readouterr().out
