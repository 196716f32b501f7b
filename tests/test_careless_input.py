"""Careless input through the real CLI: huge numbers, absurd bandwidths, flags that would be ignored, the same
file twice, malformed logs. Each gets one clear error line naming the flag, field or file (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eplb.cli import main
from eplb.errors import EplbError
from eplb.io.logs import as_log, open_log
from solvers.plan import PlanError, build_plan
from tests.cli_run import error_prefix, last_line, run_eplb

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DECODE = FIXTURES / "sglang6017-dsv3-decode-in1000out1000.json"  # 58 x 256: DeepSeek-V3, a model for bytes
HUGE = "99999999999999999999999"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """(exit code, last stderr line) of `eplb ARGV`; no traceback allowed."""
    code, err = run_eplb(capsys, *argv)
    return code, last_line(err)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-layer x 16-expert window with a current placement (no model preset has 16 experts), a synthetic
    log of that shape and a token-level one (for --coactivation), and a DeepSeek-V3 placement on 8 GPUs for the
    decode window."""
    d = tmp_path_factory.mktemp("careless")
    window = d / "w.json"
    window.write_text(json.dumps({"loads": (np.arange(32).reshape(2, 16) + 1).tolist()}))
    files = {"window": window, "current": d / "p.json", "log": d / "log.npz", "dsv3": d / "p8.json",
             "tokens": d / "topk.npz"}
    shape = ["--layers", "2", "--experts", "16", "--top-k", "2", "--tokens", "64", "--hot-ratio", "4"]
    for argv in (["solve", "--loads", str(window), "--gpus", "4", "--out", str(files["current"])],
                 ["synth", "--out", str(files["log"]), "--steps", "20", *shape],
                 ["synth", "--out", str(files["tokens"]), "--steps", "4", "--format", "topk", *shape],
                 ["solve", "--loads", str(DECODE), "--gpus", "8", "--redundant", "8", "--out", str(files["dsv3"])]):
        assert main(argv) == 0
    return files


# 1. huge integers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-moves", HUGE, "at most 10,000,000 expert copies"),
        ("--max-moves", str(2**63), "at most 10,000,000 expert copies"),
        ("--max-moves-per-layer", HUGE, "at most 1,000,000 expert copies per layer"),
    ],
)
def test_huge_move_budgets_are_refused_by_name(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    code, err = run(capsys, "solve", "--loads", str(small["window"]), "--gpus", "4", "--current",
                    str(small["current"]), flag, value)  # fmt: skip
    assert code == 2 and f"argument {flag}: {value} is too large" in err and message in err


def test_the_largest_move_budget_is_accepted(small: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["solve", "--loads", str(small["window"]), "--gpus", "4", "--current", str(small["current"]),
                 "--max-moves", "10000000", "--max-moves-per-layer", "1000000"]) == 0  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--interval", HUGE, "at most 2,147,483,647 steps"),
        ("--window", HUGE, "at most 2,147,483,647 steps"),
        ("--first-rebalance", HUGE, "at most 2,147,483,647 steps"),
        ("--oracle-every", HUGE, "at most 2,147,483,647 steps"),
        ("--slots-per-gpu", "99999999999999999999", "at most 2,147,483,647"),
        ("--gpus", "99999999999999999999", "at most 65,536 GPUs"),
    ],
)
def test_huge_replay_numbers_are_refused_by_name(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    code, err = run(capsys, "replay", str(small["log"]), flag, value, "--no-progress")
    assert code == 2 and f"argument {flag}: {value} is too large" in err and message in err


def test_huge_slots_per_gpu_in_solve(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "solve", "--slots-per-gpu", "99999999999999999999")
    assert code == 2 and "argument --slots-per-gpu: 99999999999999999999 is too large" in err


# 2. non-finite stage budget; 3. one file for two outputs ---------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "0"])
def test_stage_gib_must_be_finite_and_positive(
    small: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    code, err = run(capsys, "solve", "--loads", str(DECODE), "--gpus", "8", "--redundant", "8", "--current",
                    str(small["dsv3"]), "--target-lb", "1.01", "--plan", str(tmp_path / "plan.json"),
                    "--stage-gib", value)  # fmt: skip
    assert code == 2 and "--stage-gib must be > 0 and at most 1e+06 GiB" in err


def test_build_plan_refuses_an_infinite_stage_budget() -> None:
    with pytest.raises(PlanError, match="finite"):
        build_plan([[0, 1]], [[1, 0]], [1, 1], bytes_per_copy=1.0, stage_bytes=float("inf"))


def test_stage_gib_without_current_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "solve", "--stage-gib", "1")
    assert code == 2 and "--stage-gib" in err and "need --current" in err


def test_plan_and_out_on_one_file_are_refused(
    small: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    same = tmp_path / "x.json"
    common = ["solve", "--loads", str(small["window"]), "--gpus", "4", "--current", str(small["current"])]
    code, err = run(capsys, *common, "--out", str(same), "--plan", str(tmp_path / "." / "x.json"))
    assert code == 2 and "--plan and --out are both" in err and not same.exists()
    before = small["current"].read_text()
    code, err = run(capsys, *common, "--plan", str(small["current"]))
    assert code == 2 and "is the input (--current" in err and small["current"].read_text() == before


# 4. flags that would be silently ignored -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("trigger", "shown"), [(["--trigger", "periodic"], "periodic:"), ([], "periodic (the default)")]
)
def test_threshold_without_the_threshold_trigger_is_refused(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str], trigger: list[str], shown: str
) -> None:
    code, err = run(capsys, "replay", str(small["log"]), *trigger, "--threshold", "1.2", "--no-progress")
    assert code == 2 and "--threshold is used by --trigger threshold only" in err and shown in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--interval", "10", "--robust-windows", "15"], "--robust-windows 15: the window of the first check (step 10, "
     "--interval) holds 10 steps (--interval), too few for 15 sub-windows of a step or more: give --robust-windows "
     "2 .. 10"),
    (["--interval", "10", "--window", "8", "--robust-windows", "9"], "--robust-windows must be 2 .. --window (8)"),
    (["--interval", "10", "--first-rebalance", "1", "--robust-windows", "2"], "holds 1 step (--first-rebalance), "
     "too few for 2 sub-windows of a step or more: drop --robust-windows or give a later --first-rebalance"),
])
def test_more_robust_sub_windows_than_the_window_holds_steps_are_refused(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    """`--interval 100 --robust-windows 900` ran 'robust over 900 sub-windows' of the first check's 100 steps (the
    replay cut 100 of a step each, and said 900)."""
    code, err = run(capsys, "replay", str(small["log"]), *flags, "--no-progress")
    assert code == 2 and message in err, err
    assert main(["replay", str(small["log"]), "--interval", "10", "--robust-windows", "10", "--no-progress",
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["schedule"]["robust_windows"] == 10


def test_threshold_with_its_trigger_runs(small: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(small["log"]), "--interval", "10", "--window", "10", "--trigger", "threshold",
                 "--threshold", "1.2", "--no-progress", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["schedule"]["threshold"] == 1.2


@pytest.mark.parametrize("flag", [["--link", "nic"], ["--migration-link", "nic"], ["--migration", "blocking"],
                                  ["--migration-share", "0.5"], ["--migration-stall-ms", "800"],
                                  ["--hardware", "h100"], ["--tokens-per-gpu", "256"], ["--no-overlap"],
                                  ["--overlap"]])  # fmt: skip
def test_cost_flags_without_a_model_are_refused(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    code, err = run(capsys, "replay", str(small["log"]), *flag, "--no-progress")
    assert code == 2 and err.startswith(f"eplb replay: error: {flag[0]} ") and "needs a model" in err


def test_link_without_a_model_is_refused_by_solve(small: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "solve", "--loads", str(small["window"]), "--gpus", "4", "--link", "nic")
    assert code == 2 and "--link times the all-to-all, which needs a model" in err
    # --hardware and --tokens-per-gpu were silently ignored without a model (replay's too, above)
    for flag, what in ((["--hardware", "h100"], "is the GPU the time prediction runs on"),
                       (["--tokens-per-gpu", "256"], "sizes the step the time prediction times"),
                       (["--node-limit", "2", "--gpus-per-node", "2", "--coactivation", str(small["tokens"])],
                        "caps the predicted co-activation copies")):
        for command in ("solve", "evaluate"):
            data = ["--placement", str(small["current"])] if command == "evaluate" else ["--gpus", "4"]
            code, err = run(capsys, command, "--loads", str(small["window"]), *data, *flag)
            assert code == 2 and err == (f"eplb {command}: error: {flag[0]} {what}, which needs a model: give --model "
                                         "NAME or FILE (no preset matches the data's expert and layer count)"), err
    assert main(["solve", "--loads", str(small["window"]), "--gpus", "4", "--json"]) == 0  # the defaults pass


@pytest.mark.parametrize("command", ["solve", "replay"])
def test_groups_without_gpus_per_node_are_refused(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """--groups alone was silently ignored: the hierarchical policy needs the nodes too."""
    data = ["--loads", str(small["window"])] if command == "solve" else [str(small["log"]), "--no-progress"]
    code, err = run(capsys, command, *data, "--gpus", "4", "--groups", "2")
    assert code == 2 and err == (f"eplb {command}: error: --groups 2 needs --gpus-per-node: the hierarchical policy "
                                 "keeps each expert group within a node; give both, or drop --groups"), err
    assert main([command, *data, "--gpus", "4", "--groups", "2", "--gpus-per-node", "2", "--json"]) == 0


@pytest.mark.parametrize("flag", ["--model", "--hardware"])
def test_a_binary_spec_file_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   flag: str) -> None:
    """A --model (or --hardware) pointing at a binary file was a UnicodeDecodeError traceback."""
    spec = tmp_path / "spec.json"
    spec.write_bytes(bytes(range(256)) * 4)
    code, err = run(capsys, "solve", flag, str(spec))
    said = "not valid JSON: not UTF-8 text (byte 128); is it a binary file?"
    assert code == 2 and err == f"eplb solve: error: {spec}: {said}", err


@pytest.mark.parametrize("flag", ["--model", "--hardware"])
@pytest.mark.parametrize(("content", "said"), [
    (None, "{kind} spec file not found: {spec}"), ("", "{kind} spec file {spec} is empty (0 bytes)"),
    ('{"name": ', "{spec}: not valid JSON (Expecting value: line 1 column 10 (char 9))"),
    ('{"name": "a", "name": "b"}', "{spec}: key 'name' appears twice in one object (JSON readers keep only the last); "
                                   "give each key once"),
    ('{"nme": "a"}', "{spec}: {kind} spec: "),
], ids=["missing", "empty", "not-json", "key-twice", "bad-field"])
def test_a_spec_file_error_names_the_file_once(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str,
                                               content: str | None, said: str) -> None:
    """`/x.json: cannot read model spec file '/x.json': ...` named the file twice; now once, in the words of every
    other input file (`existing_file`, `read_json`)."""
    spec = tmp_path / "spec.json"
    if content is not None:
        spec.write_text(content)
    code, err = run(capsys, "cost", flag, str(spec), "--ep", "8", "--tokens-per-gpu", "256")
    expected = said.format(kind=flag.removeprefix("--"), spec=spec)
    assert code == 2 and err.startswith(f"eplb cost: error: {expected}") and err.count(str(spec)) == 1, err


@pytest.mark.parametrize("flag", ["--model", "--hardware"])
def test_another_eplb_file_given_as_a_spec_is_named_by_its_kind(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """A placement or a load window given as --model said 'missing field name; the fields are ...'."""
    kind = flag.removeprefix("--")
    for file, what in ((small["current"], "a placement file (phy2log)"), (small["window"], "a load window (loads)")):
        code, err = run(capsys, "cost", flag, str(file), "--ep", "8", "--tokens-per-gpu", "256")
        assert code == 2 and err.startswith(f"eplb cost: error: {file}: {what}, not a {kind} spec: give a preset ("), \
            err


@pytest.mark.parametrize(("argv", "said"), [
    (["--memory-budget-gib", "nan", "--model", "deepseek-v3"], "--memory-budget-gib must be finite and >= 0, got nan"),
    (["--memory-budget-gib", "-1", "--model", "deepseek-v3"],
     "--memory-budget-gib must be finite and >= 0, got -1 GiB"),
    (["--memory-budget-gib", "20,20", "--model", "deepseek-v3"],
     "--memory-budget-gib: got 2 values for 32 GPUs (give one, or one per GPU)"),
    (["--memory-budget-gib", "1", "--model", "deepseek-v3"], "--memory-budget-gib: a budget of 1.00 GiB on GPU 0 "
     "fits no expert: one expert slot across all MoE layers takes 2.38 GiB"),
    (["--slots-per-gpu", "9,9"], "--slots-per-gpu: got 2 values for 32 GPUs (give one, or one per GPU)"),
    (["--slots-per-gpu", "0"], "--slots-per-gpu: every GPU needs at least one expert slot"),
    (["--slots-per-gpu", "7"], "--slots-per-gpu: 224 slots in all cannot hold 256 experts: need at least 8 slots "
     "per GPU on 32 GPUs"),
    (["--redundant", "-5"], "--redundant must be >= 0, got -5"),
    (["--gpus", "300", "--redundant", "0"], "--redundant: 256 experts + 0 redundant leave some of the 300 GPUs "
     "without a slot: give at least 44 redundant experts"),
    (["--redundant", "7937"], "--redundant: 7937 redundant experts put more than 256 slots (one per expert) on some "
     "of the 32 GPUs: give at most 7936 redundant experts (extra slots would only hold a second copy on the same "
     "GPU)"),
    (["--redundant", HUGE], f"--redundant: {HUGE} redundant experts put more than 256 slots (one per expert) on "
     "some of the 32 GPUs: give at most 7936 redundant experts (extra slots would only hold a second copy on the "
     "same GPU)"),  # was an OverflowError traceback
    (["--gpus", "0"], "--gpus must be at least 1, got 0"),
])  # fmt: skip
def test_slot_budget_errors_name_the_flags(capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    """eplb.budget described the quantity ('memory budget must be finite and >= 0'), not the flag; the Python API
    and the service keep the quantities' names."""
    from eplb.budget import GIB, slots_per_gpu

    code, err = run(capsys, "solve", *argv)
    assert code == 2 and err == f"eplb solve: error: {said}", err
    with pytest.raises(EplbError, match=r"^memory budget must be finite and >= 0, got nan$"):
        slots_per_gpu(32, 256, memory_budget_bytes=float("nan"), slot_bytes=GIB)
    with pytest.raises(EplbError, match=r"^slots per GPU: got 2 values for 32 GPUs"):
        slots_per_gpu(32, 256, slots=[9, 9])


# 5. absurd tokens and bandwidths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["solve", "--tokens-per-gpu", "1e300"], "--tokens-per-gpu must be > 0 and at most 1,000,000,000"),
        (["solve", "--link", "1e-300"], "--link 1e-300: 1e-300 GB/s is not a link bandwidth"),
        (["solve", "--link", "1e300"], "is not a link bandwidth"),
        (["solve", "--gpus", "32", "--gpus-per-node", "8", "--link", "nvlink+1e-9"], "1e-09 GB/s is not a link"),
        (["cost", "--ep", "8", "--tokens-per-gpu", "256", "--link", "1e-300"], "--link 1e-300: 1e-300 GB/s is not"),
        (["cost", "--ep", "8", "--tokens-per-gpu", "10000000000"], "--tokens-per-gpu 10000000000 is too large"),
    ],
)
def test_absurd_tokens_and_links_are_refused(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_absurd_migration_link_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "dsv3.npz"  # DeepSeek-V3's shape: the log names its model
    assert main(["synth", "--out", str(log), "--steps", "4", "--tokens", "64"]) == 0
    capsys.readouterr()
    code, err = run(capsys, "replay", str(log), "--migration-link", "1e-300", "--no-progress")
    assert code == 2 and "--migration-link 1e-300: 1e-300 GB/s is not a link bandwidth" in err
    for stall in ("-1", "nan", "inf", "1e12"):
        code, err = run(capsys, "replay", str(log), "--migration-stall-ms", stall, "--no-progress")
        assert code == 2 and f"--migration-stall-ms must be 0 to 3.6e+06 ms, got {float(stall):g}" in err
    assert main(["replay", str(log), "--migration-stall-ms", "800", "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["migration"]["fixed_stall_s"] == 0.8


# 6., 7. readers ---------------------------------------------------------------------------------------------


def _topk(path: Path, ids: list[list[list[int]]], offsets: object, num_experts: int = 4) -> Path:
    np.savez(path, topk_ids=np.asarray(ids, dtype=np.int16), step_offsets=np.asarray(offsets),
             num_experts=np.int64(num_experts))  # fmt: skip
    return path


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("big.jsonl", '{"step": 0, "layer": 0, "counts": [1e30, 1, 2, 3]}\n',
         "line 1: step 0, layer 0, expert 0: count is 1e+30, too large for a token count"),
        ("bool.jsonl", '{"step": 0, "layer": 0, "counts": [1, true, 2, 3]}\n', "line 1: counts[1] is true"),
    ],
)
def test_bad_jsonl_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: str,
                          message: str) -> None:  # fmt: skip
    path = tmp_path / name
    path.write_text(content)
    code, err = run(capsys, "replay", str(path), "--no-progress")
    assert code == 2 and f"{path}: {message}" in err


def test_bools_and_complex_loads_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    window = tmp_path / "w.json"
    window.write_text('{"loads": [[1, 2, false, 4]]}')
    code, err = run(capsys, "solve", "--loads", str(window), "--gpus", "2", "--slots-per-gpu", "2")
    assert code == 2 and "loads[0][2] is false: give a number, not true/false" in err
    npy = tmp_path / "w.npy"
    np.save(npy, np.array([[1 + 2j, 3, 4, 5]]))
    code, err = run(capsys, "solve", "--loads", str(npy), "--gpus", "2", "--slots-per-gpu", "2")
    assert code == 2 and "must hold real numbers (integers or floats), got dtype complex128" in err


def test_float_step_offsets_are_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _topk(tmp_path / "t.npz", [[[0, 1]], [[1, 3]], [[0, 3]]], np.array([0.0, 2.0, 3.0]))
    code, err = run(capsys, "replay", str(path), "--no-progress")
    assert code == 2 and "step_offsets must be integers (token positions), got dtype float64" in err


def test_a_repeated_expert_in_one_top_k_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _topk(tmp_path / "t.npz", [[[0, 1], [2, 3]], [[1, 3], [0, 1]], [[0, 3], [2, 2]]], [0, 2, 3])
    code, err = run(capsys, "replay", str(path), "--no-progress")
    assert code == 2 and "step 1, token 2, layer 1: top-k [2, 2] names an expert twice" in err
    code, err = run(capsys, "solve", "--loads", str(path), "--gpus", "2")
    assert code == 2 and "names an expert twice" in err


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("esft-*-topk.npz")), ids=lambda p: p.name)
def test_shipped_token_logs_pick_distinct_experts(fixture: Path) -> None:
    log = open_log(fixture)
    assert sum(chunk.num_steps for chunk in log.iter_counts(4096)) == log.info.num_steps


def test_an_unreasonable_expert_count_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _topk(tmp_path / "t.npz", [[[0, 1]], [[1, 3]], [[0, 3]]], [0, 2, 3], num_experts=10**12)
    code, err = run(capsys, "replay", str(path), "--no-progress")
    assert code == 2 and "num_experts is 1,000,000,000,000: more than int16 topk_ids can name (at most 32,768)" in err
    with pytest.raises(EplbError, match="at most 32,768"):
        open_log(path)


@pytest.mark.parametrize("value", [HUGE, str(2**60)])
def test_a_huge_id_in_a_placement_file_is_refused_not_wrapped(
    small: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    data = json.loads(small["current"].read_text())
    text = json.dumps(data).replace(f'"phy2log": [[{data["phy2log"][0][0]},', f'"phy2log": [[{value},', 1)
    assert text != json.dumps(data)
    bad = tmp_path / "big.json"
    bad.write_text(text)
    code, err = run(capsys, "solve", "--loads", str(small["window"]), "--gpus", "4", "--current", str(bad))
    assert code == 2 and "phy2log holds" in err and "too large" in err


def test_a_window_longer_than_the_log_needs_no_bigger_buffer(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # the largest window the CLI takes: its ring buffer was sized to it (16 GiB of lb alone) before the log
    code, err = run(capsys, "replay", str(small["log"]), "--window", str(2**31 - 1), "--interval", "10",
                    "--trigger", "periodic", "--solver", "greedy", "--oracle-every", "0")  # fmt: skip
    assert code == 0, err


def test_a_target_lb_the_budget_cannot_reach_is_said(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prefill = FIXTURES / "sglang6017-dsv3-prefill-in4096.json"
    base = ["solve", "--loads", str(prefill), "--gpus", "8", "--redundant", "8", "--current", str(small["dsv3"]),
            "--target-lb", "1.01"]  # fmt: skip
    assert main([*base, "--max-moves", "10"]) == 0
    assert "target lb 1.01: reached on 0 of 58 layers (a move budget ran out first)" in capsys.readouterr().out
    assert main(base) == 0
    assert "target lb 1.01: reached on 58 of 58 layers\n" in capsys.readouterr().out


@pytest.mark.parametrize("cell", ['"1e3"', "null", "[1]", '{"a": 1}'])
def test_loads_that_are_not_numbers_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], cell: str) -> None:
    # numpy would parse the string "1e3" as a number, and None as NaN
    window = tmp_path / "w.json"
    window.write_text('{"loads": [[1, 2, ' + cell + ', 4]]}')
    code, err = run(capsys, "solve", "--loads", str(window), "--gpus", "2")
    assert code == 2 and "loads must be numbers" in err


def test_a_flag_beside_the_numbers_is_no_bool_among_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    window = tmp_path / "w.json"
    window.write_text('{"loads": [[1, 2, 3, 4]], "note": "a flag is fine", "checked": true}')
    code, err = run(capsys, "solve", "--loads", str(window), "--gpus", "2")
    assert code == 0, err


def test_a_zero_move_budget_is_named_as_the_reason(small: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    prefill = FIXTURES / "sglang6017-dsv3-prefill-in4096.json"
    assert main(["solve", "--loads", str(prefill), "--gpus", "8", "--redundant", "8", "--current", str(small["dsv3"]),
                 "--target-lb", "1.01", "--max-moves", "0"]) == 0  # fmt: skip
    assert "reached on 0 of 58 layers (a move budget ran out first)" in capsys.readouterr().out


def test_a_summary_of_other_layers_names_both_shapes(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    law = FIXTURES / "esft-dsv2lite-law-topk.npz"  # 26 layers x 64 experts
    window = small["window"].parent / "w26.json"
    window.write_text(json.dumps({"loads": np.ones((2, 64)).tolist()}))
    code, err = run(capsys, "solve", "--loads", str(window), "--gpus", "8", "--coactivation", str(law))
    assert code == 2 and "is for 26 layers x 64 experts, the loads are 2 x 64" in err


def test_replay_names_an_unknown_solver() -> None:
    from eplb.replay import Schedule, replay
    from eplb.solve import Cluster

    with pytest.raises(EplbError, match="nosuch"):
        replay(np.ones((10, 2, 8), dtype=np.int64), Cluster(np.full(4, 3)), schedule=Schedule(window=5, interval=5),
               solver="nosuch")  # fmt: skip


def test_a_placement_slower_than_no_eplb_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # decode (64 tokens per GPU) is bound by weight reads: 72 filled slots read more than the baseline's 64
    law = str(FIXTURES / "esft-dsv2lite-law-topk.npz")
    base = ["solve", "--loads", law, "--gpus", "8", "--tokens-per-gpu", "64"]
    current = tmp_path / "p.json"
    assert main([*base, "--out", str(current)]) == 0
    assert "fewer redundant slots (--redundant, or --objective time) read less" in capsys.readouterr().out
    assert main([*base, "--objective", "time", "--current", str(current)]) == 0
    assert "only from scratch" in capsys.readouterr().out
    assert main([*base, "--objective", "time"]) == 0  # from scratch: one slot per expert, not slower
    assert "note: slower" not in capsys.readouterr().out


def test_a_true_in_a_foreign_placement_file_is_refused(small: dict[str, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # SGLang's format: true would read as expert 1
    bad = tmp_path / "sglang.json"
    bad.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 3] * 3] * 2}).replace("[0, 1,", "[0, true,", 1))
    code, err = run(capsys, "solve", "--loads", str(small["window"]), "--gpus", "4", "--current", str(bad))
    assert code == 2 and "physical_to_logical_map[0][1] is true" in err


def test_integers_beyond_int64_get_the_range_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    window = tmp_path / "w.json"
    window.write_text('{"loads": [[1, 2, 3, ' + str(2**70) + ']]}')
    code, err = run(capsys, "solve", "--loads", str(window), "--gpus", "2")
    assert code == 2 and "larger than any token count" in err


def test_bool_flags_are_no_numbers_and_paths_keep_their_dots() -> None:
    from eplb.io.files import refuse_bools

    refuse_bools({"moe_layers": [True, False], "loads": [[1, 2]]}, "true", "f: ")  # a list of flags is fine
    with pytest.raises(EplbError, match=r"f: meta\.x\[1\] is true"):
        refuse_bools({"meta": {"x": [1, True]}}, "true", "f: ")
    refuse_bools({"loads": [[1, True]]}, "no bool spelled", "f: ")  # the text gate: nothing to walk


def test_a_budget_not_spent_is_not_blamed_for_a_missed_target(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prefill = FIXTURES / "sglang6017-dsv3-prefill-in4096.json"
    assert main(["solve", "--loads", str(prefill), "--gpus", "8", "--redundant", "8", "--current", str(small["dsv3"]),
                 "--target-lb", "1.0001", "--max-moves", "100000"]) == 0  # fmt: skip
    assert "(no edit of the serving placement gets there)" in capsys.readouterr().out


def test_a_number_string_in_a_placement_file_is_refused(small: dict[str, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(small["current"].read_text())
    data["phy2log"][0][0] = str(data["phy2log"][0][0])  # numpy would read "3" as 3
    bad = tmp_path / "strings.json"
    bad.write_text(json.dumps(data))
    code, err = run(capsys, "solve", "--loads", str(small["window"]), "--gpus", "4", "--current", str(bad))
    assert code == 2 and "phy2log must be a list of lists of numbers" in err


# eplb/io readers: integers beyond float range, npz counts no token count can be, header-less JSONL logs ----------


def test_an_integer_beyond_float_range_gets_the_range_message(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    window = tmp_path / "big.json"
    loads = (np.arange(32).reshape(2, 16) + 1).tolist()
    loads[0][3] = 10**400
    window.write_text(json.dumps({"loads": loads}))
    code, err = run(capsys, "solve", "--loads", str(window), "--gpus", "8")
    assert code == 2 and f"{window}: loads[0][3] is more than 1.8e+308: larger than any token count (limit 1e+15)" \
        in err
    log = tmp_path / "bigint.jsonl"
    log.write_text('{"step": 0, "layer": 0, "counts": [1, 2, ' + str(10**400) + ", 3]}\n")
    for argv in (["replay", str(log), "--no-progress"], ["logs", "convert", str(log), str(tmp_path / "x.npz")]):
        code, err = run(capsys, *argv)
        assert code == 2 and (f"{log}: line 1: step 0, layer 0, expert 2: count is more than 1.8e+308, too large for a "
                              "token count (at most 1e+15)") in err  # fmt: skip


@pytest.mark.parametrize(("dtype", "value", "shown"), [
    (np.float64, 1e30, "1e+30, too large for a token count"), (np.int64, 2**62, "4611686018427387904, too large"),
    (np.uint64, 2**63 + 5, "9223372036854775813, too large"), (np.float64, 1.5, "1.5; counts must be whole numbers"),
])  # fmt: skip
def test_npz_counts_no_window_takes_are_refused_by_replay(
    small: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: type, value: float, shown: str
) -> None:
    counts: np.ndarray = open_log(small["log"]).read_counts().counts.astype(dtype)
    counts[10, 0, 3] = value
    np.savez(huge := tmp_path / "huge.npz", counts=counts)
    code, err = run(capsys, "replay", str(huge), "--interval", "10", "--window", "10", "--no-progress")
    assert code == 2 and f"{huge}: step 10 (position 10), layer 0, expert 3: count is {shown}" in err


def test_a_headerless_jsonl_log_replays_under_any_window_and_a_header_understating_its_steps_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from eplb.io.logs import write_jsonl

    log = tmp_path / "nohdr.jsonl"
    write_jsonl(log, np.random.default_rng(1).integers(0, 100, (30, 4, 16)), header=False)
    assert main(["replay", str(log), "--window", "100000000", "--interval", "10", "--gpus", "8", "--oracle-every",
                 "0", "--no-progress"]) == 0  # fmt: skip
    assert "30 steps x 4 layers x 16 experts" in capsys.readouterr().out
    headed = tmp_path / "under.jsonl"
    write_jsonl(headed, np.random.default_rng(1).integers(0, 100, (50, 4, 16)))
    headed.write_text(headed.read_text().replace('"num_steps": 50', '"num_steps": 10', 1))
    code, err = run(capsys, "replay", str(headed), "--interval", "2", "--window", "2", "--gpus", "8", "--no-progress")
    assert code == 2 and f"{headed}: the file holds more steps than its header says (num_steps 10)" in err


@pytest.mark.parametrize(("steps", "said"), [
    (np.array([0, 1, 2**63 + 1], dtype=np.uint64), "steps[2] is 9223372036854775809 (uint64): step ids are at most "
     "2**63 - 1"),  # was "got dtype float64": the ids went through a list
    (np.array([0.0, 1.0, 2.0]), "'steps' must be integer step ids, got dtype float64"),
])  # fmt: skip
def test_npz_step_ids_are_judged_by_their_own_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    steps: np.ndarray, said: str) -> None:
    log = tmp_path / "log.npz"
    np.savez(log, counts=np.ones((3, 1, 4), dtype=np.uint16), steps=steps)
    code, err = run(capsys, "replay", str(log), "--gpus", "2", "--interval", "1", "--delay", "0", "--no-progress")
    assert code == 2 and err == f"eplb replay: error: {log}: {said}", err
    np.savez(log, counts=np.ones((3, 1, 4), dtype=np.uint16), steps=np.array([5, 7, 2**63 - 1], dtype=np.uint64))
    assert open_log(log).read_counts().steps.tolist() == [5, 7, 2**63 - 1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--robust-windows", "4", "--window", "2"], "--robust-windows must be 2 .. --window (2), got 4"),
        (["--oracle-every", "-1"], "--oracle-every must be >= 0 (0 skips the oracle), got -1"),
        (["--interval", "1"], "--delay (1) must be shorter than --interval (1): a placement must serve before the "
         "next rebalance; give --delay 0"),
        (["--ewma", "0"], "--ewma (EWMA alpha) must be in (0, 1], got 0.0"),
        (["--first-rebalance", "0"], "--first-rebalance must be >= 1"),
        (["--window", "0"], "--window must be a whole number of steps >= 1, got 0"),
        (["--threshold", "0.5", "--trigger", "threshold"], "--threshold is a realized lb >= 1, got 0.5"),
    ],
)
def test_replay_schedule_errors_name_the_flags(
    small: dict[str, Path], capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, err = run(capsys, "replay", str(small["log"]), "--gpus", "4", "--no-progress", *argv)
    assert code == 2 and message in err


def test_migration_share_out_of_range_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "v3.npz"
    assert main(["synth", "--out", str(log), "--steps", "4", "--layers", "1"]) == 0
    capsys.readouterr()
    for share in ("1", "0", "nan"):
        code, err = run(capsys, "replay", str(log), "--migration-share", share, "--no-progress")
        assert code == 2 and "--migration-share is the fraction of the link the copies take, in (0, 1)" in err


def test_a_log_without_tokens_is_refused_by_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from eplb.io.logs import write_counts

    log = tmp_path / "zero.npz"
    write_counts(log, np.zeros((30, 2, 16), dtype=np.uint16))
    code, err = run(capsys, "replay", str(log), "--gpus", "4", "--interval", "10", "--window", "10", "--no-progress")
    assert code == 2 and f"{log}: no step has tokens (every count is 0): there is no lb or time to report" in err


def test_replay_refuses_a_time_limit_its_solver_does_not_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "dsv3.npz"
    assert main(["synth", "--out", str(log), "--steps", "4", "--tokens", "64"]) == 0
    capsys.readouterr()
    code, err = run(capsys, "replay", str(log), "--time-limit", "3", "--no-progress")
    assert code == 2 and "solver 'incremental' does not take --time-limit (it has no time limit)" in err
    assert "milp" in err


def test_an_oracle_whose_sampled_steps_are_empty_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = np.random.default_rng(0).integers(0, 50, (40, 2, 16))
    counts[::2] = 0  # the oracle samples every second step: all of them empty
    path = tmp_path / "odd.npz"
    np.savez(path, counts=counts)
    assert main(["replay", str(path), "--gpus", "4", "--interval", "10", "--window", "10", "--oracle-every", "2",
                 "--no-progress"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "oracle (per step)" in out and "(its sampled steps have no tokens)" in out


@pytest.mark.parametrize(("name", "arrays", "said"), [
    ("layers0.npz", {"counts": np.zeros((5, 0, 8), np.uint16)}, "counts has 0 layers (shape [5, 0, 8])"),
    ("experts0.npz", {"counts": np.zeros((5, 2, 0), np.uint16)}, "counts has 0 experts per layer (shape [5, 2, 0])"),
    ("layers0.npy", np.zeros((5, 0, 8), np.int64), "counts has 0 layers (shape [5, 0, 8])"),
    ("topk-layers0.npz", {"topk_ids": np.zeros((3, 0, 2), np.int16), "step_offsets": np.array([0, 3]),
                          "num_experts": 4}, "topk_ids has 0 layers (shape [3, 0, 2])"),
    ("topk-k0.npz", {"topk_ids": np.zeros((3, 2, 0), np.int16), "step_offsets": np.array([0, 3]),
                     "num_experts": 4}, "topk_ids has 0 experts per token (shape [3, 2, 0])"),
])  # fmt: skip
def test_a_log_with_no_layers_or_experts_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, arrays: dict[str, Any] | np.ndarray, said: str
) -> None:
    """0 layers replayed with numpy's warnings into 'no step has tokens (every count is 0)', a token-level one
    into an IndexError; `eplb logs convert` wrote it on (an unreadable JSONL, a '0 layers' npz)."""
    log = tmp_path / name
    if isinstance(arrays, dict):
        np.savez(log, **arrays)
    else:
        np.save(log, arrays)
    for argv in (["replay", str(log), "--gpus", "2"], ["logs", "convert", str(log), str(tmp_path / "out.jsonl")]):
        code, err = run(capsys, *argv)
        assert code == 2 and err.endswith(f"{log}: {said}" + ("; a routing log records at least one MoE layer"
                                                              if "0 layers" in said else "")), err
    assert not (tmp_path / "out.jsonl").exists()
    with pytest.raises(EplbError, match=r"<array>: counts has 0 layers \(shape \[3, 0, 4\]\)"):
        as_log(np.zeros((3, 0, 4)))


def test_log_outputs_that_cannot_be_written_are_refused_before_the_work(
    small: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory, a file in the way of the directory, or a directory that cannot be made as the output of
    `eplb synth`, `eplb logs convert` and `eplb replay --out`: tracebacks (IsADirectoryError after the whole
    synthesis, FileExistsError, FileNotFoundError), and no NAME.part left behind."""
    folder = tmp_path / "log.npz"
    folder.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    synth = ["synth", "--steps", "3", "--layers", "2", "--experts", "16", "--top-k", "2", "--tokens", "64",
             "--hot-ratio", "4"]
    for argv, said in [
        ([*synth, "--out", str(folder)], f"{folder} is a directory; give a file name"),
        ([*synth, "--format", "topk", "--out", str(folder)], f"{folder} is a directory; give a file name"),
        ([*synth, "--out", str(a_file / "log.jsonl")], f"--out {a_file}/log.jsonl: cannot write there ({a_file} is "
                                                      "not a directory)"),
        (["logs", "convert", str(small["log"]), str(folder)], f"{folder} is a directory; give a file name"),
        (["logs", "convert", str(small["log"]), str(a_file / "x.npz")], f"{a_file}/x.npz: cannot write there "
                                                                        f"({a_file} is not a directory)"),
        (["logs", "convert", str(small["log"]), str(a_file / "x.parquet")], f"cannot write {a_file}/x.parquet: "),
        (["logs", "convert", str(small["log"]), str(tmp_path / "p.parquet"), "--shard-steps", "0"],
         "--shard-steps must be >= 1 (steps per shard file), got 0"),
        (["replay", str(small["log"]), "--gpus", "4", "--out", str(a_file / "run")],
         f"--out {a_file}/run: cannot write there"),
        ([*synth, "--out", f"{tmp_path}/new.npz/"], f"--out {tmp_path}/new.npz/ ends in '/' (a directory's name), "
                                                     f"but there is no such directory: give a file name, e.g. "
                                                     f"{tmp_path}/new.npz"),  # it wrote the file new.npz
        ([*synth, "--out", "-"], "--out '-' would be a file named '-': give a file name (an output option writes "
                                 "a file, not standard output)"),  # it wrote a file '-' in the working directory
    ]:
        code, err = run(capsys, *argv)
        assert code == 2 and said in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "log.npz"] and not any(folder.iterdir())


def test_converting_a_log_without_steps_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 0-step log converted to JSONL left an empty file (unreadable), to npz one that said 0 experts."""
    log = tmp_path / "empty.npz"
    np.savez(log, counts=np.zeros((0, 2, 8), np.uint16))
    for out in ("o.jsonl", "o.npz", "o.parquet"):
        code, err = run(capsys, "logs", "convert", str(log), str(tmp_path / out))
        assert code == 2 and err.endswith(f"{log}: the log has no steps: nothing to convert"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.npz"]


@pytest.mark.parametrize(("argv", "said"), [
    (["--seed", "-1"], "--seed must be >= 0 (numpy's seeds are non-negative), got -1"),
    (["--preset", "seed004", "--steps", "-3"], "--steps must be >= 1, got -3"),
    (["--preset", "seed004", "--steps", "0"], "--steps must be >= 1, got 0"),  # was silently 1
    (["--preset", "seed004", "--layers", "0"], "--layers must be >= 1, got 0"),
])  # fmt: skip
def test_synth_refuses_seeds_and_seed004_sizes_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    code, err = run(capsys, "synth", "--out", str(tmp_path / "log.npz"), *argv)
    assert code == 2 and err == f"eplb synth: error: {said}", err
    assert not list(tmp_path.iterdir())


def test_a_bad_link_names_its_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`eplb replay` takes two links: 'link must be ...' did not say which flag it was about."""
    log = tmp_path / "v2lite.npz"
    assert main(["synth", "--out", str(log), "--steps", "10", "--layers", "2", "--experts", "64", "--top-k", "6",
                 "--tokens", "256", "--model", "deepseek-v2-lite", "--hot-ratio", "5"]) == 0  # fmt: skip
    capsys.readouterr()
    for flag in ("--link", "--migration-link"):
        code, err = run(capsys, "replay", str(log), "--gpus", "4", flag, "foo")
        assert code == 2 and err.endswith(f"error: {flag} foo: link must be 'nvlink', 'nic', 'pcie' or a bandwidth in "
                                          "GB/s per GPU and direction, got 'foo'"), err
    code, err = run(capsys, "solve", "--link", "0")
    assert code == 2 and err.endswith("--link 0: link bandwidth must be a positive number of GB/s, got '0'"), err
    code, err = run(capsys, "cost", "--model", "deepseek-v3", "--ep", "8", "--tokens-per-gpu", "256", "--link", "0")
    assert code == 2 and "--link 0: link bandwidth must be" in err, err


@pytest.mark.parametrize(("first", "said"), [
    ('{"num_steps": 1e300}', "metadata num_steps is 1e+300: too large (at most 9,007,199,254,740,992)"),
    ('{"num_steps": NaN}', "metadata num_steps must be a positive integer, got nan"),  # a ValueError
    ('{"num_experts": Infinity}', "metadata num_experts must be a positive integer, got inf"),  # an OverflowError
    ('{"layer_ids": "abc"}', "layer_ids: must hold only numbers"),  # a ValueError
    ('{"layer_ids": [true]}', "layer_ids: must be a list of integers, got [True]"),
    ('{"step": 100000000000000000000000, "layer": 0, "counts": [1, 2]}',
     "line 1: 'step' must be an integer 0 .. 2**63 - 1, got 100000000000000000000000"),  # an OverflowError
])  # fmt: skip
def test_jsonl_numbers_beyond_what_a_log_holds_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], first: str, said: str
) -> None:
    """A header's 1e300 steps passed as a positive integer (and was then printed in full); NaN, Infinity, a string
    of layer ids and a step id beyond int64 were tracebacks."""
    log = tmp_path / "log.jsonl"
    log.write_text(first + '\n{"step": 0, "layer": 0, "counts": [1, 2]}\n')
    code, err = run(capsys, "replay", str(log), "--gpus", "2", "--interval", "1", "--delay", "0")
    assert code == 2 and err.endswith(f"{log}: {said}"), err


def test_synth_sizes_beyond_memory_are_one_line_naming_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """numpy's MemoryError (here 7 PiB of popularity for 10^15 experts: beyond any address space, refused at once)
    was a traceback."""
    out = tmp_path / "log.npz"
    code, err = run(capsys, "synth", "--out", str(out), "--steps", "2", "--experts", str(10**15))
    assert code == 2 and err.startswith("eplb synth: error: out of memory (Unable to allocate"), err
    assert err.endswith("the log's --layers x --experts arrays do not fit; lower them"), err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("argv", "said"), [
    (["--top-k", "300"], "--top-k (300) must not exceed --experts (256)"),  # was "synth: top_k (300) ..."
    (["--groups", "7"], "--groups 7: 256 experts do not split into 7 equal groups"),
    (["--drift-steps", "0"], "--drift-steps must be > 0, got 0.0"),
    (["--hot-ratio", "0.5"], "--hot-ratio must be >= 1 (hottest / mean), got 0.5"),
    (["--steps", "100", "--shift-at", "50,100"],  # past the log's end: was silently no shift
     "--shift-at 100: a regime shift happens at a step of the log, 0 .. 99 (--steps 100)"),
    (["--shift-at", "-1"], "--shift-at -1: a regime shift happens at a step of the log, 0 .. 3999 (--steps 4000)"),
    (["--shift-at", "30,3,30"], "--shift-at 30: the step is given twice; give each shift once"),
    (["--steps", str(2**31)], "argument --steps: 2147483648 is too large (at most 2,147,483,647 steps)"),
])  # fmt: skip
def test_synth_errors_name_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                     said: str) -> None:
    """eplb.synth's messages said 'synth: steps ...', the fields; the Python API keeps them."""
    from eplb.synth import SynthConfig

    code, err = run(capsys, "synth", "--out", str(tmp_path / "log.npz"), *argv)
    assert code == 2 and err == f"eplb synth: error: {said}", err
    assert not list(tmp_path.iterdir())
    with pytest.raises(EplbError, match=r"^synth: shift_at 100: a regime shift happens at a step of the log, 0 \.\. 99 "
                       r"\(steps 100\)$"):
        SynthConfig(steps=100, shift_at=(100,)).check()


@pytest.mark.parametrize(("name", "argv", "what"), [
    ("log.npz", ["--steps", "2147483647"], "63,771.7 GB (--steps 2,147,483,647 x --layers 58 x --experts 256 "
     "counts of 2 bytes)"),
    ("log.jsonl", ["--steps", "100000000"], "2,969.6 GB (--steps 100,000,000 x --layers 58 x --experts 256 counts "
     "of 2 bytes)"),
    ("log.npz", ["--format", "topk", "--steps", "1000000"], "3,801.1 GB (--steps 1,000,000 x --layers 58 x --tokens "
     "4,096 x --top-k 8 expert ids of 2 bytes)"),
    ("log.npz", ["--preset", "seed004", "--steps", "1000000000", "--layers", "58"], "29,696.0 GB (--steps "
     "1,000,000,000 x --layers 58 x 256 experts' counts of 2 bytes)"),
])  # fmt: skip
def test_synth_steps_beyond_the_disk_are_refused_before_the_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, argv: list[str], what: str
) -> None:
    """--steps had no upper bound: a log larger than the disk ran until the disk was full (hours of drawing
    steps). Refused at once, as sizes beyond memory are, naming the flags (TBs: beyond any test disk)."""
    code, err = run(capsys, "synth", "--out", str(tmp_path / name), *argv)
    assert code == 2 and err.startswith(f"eplb synth: error: the log would take {what} but {tmp_path} has "), err
    assert err.endswith(" GB free: lower them"), err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("name", "argv", "checked"), [
    ("log.npz", ["--format", "topk", "--compress"], False),
    ("log.npz", ["--format", "topk"], True),
    ("log.npz", ["--compress"], False),
    ("log.npz", [], True),
    ("log.jsonl", [], True),  # --compress with it is refused (tests/test_logs.py)
    ("log.npz", ["--preset", "seed004", "--compress"], False),
])  # fmt: skip
def test_synth_checks_the_disk_for_what_it_writes_uncompressed_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, name: str,
    argv: list[str], checked: bool
) -> None:
    """--format topk --compress was refused on the size of the ids uncompressed, while a --compress counts log
    skipped the check (how much deflate saves is the data's to decide): both skip it now; a .jsonl is checked."""
    import shutil
    from types import SimpleNamespace

    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(total=10**12, free=1000))  # 1 kB free
    shape = ["--steps", "20", "--layers", "2"] + ([] if "seed004" in argv else
                                                  ["--experts", "16", "--top-k", "2", "--tokens", "64",
                                                   "--hot-ratio", "4"])
    code, err = run(capsys, "synth", "--out", str(tmp_path / name), *shape, *argv)
    if checked:
        assert code == 2 and err.startswith("eplb synth: error: the log would take 0.0 GB") and \
            err.endswith(" GB free: lower them"), err
        assert not list(tmp_path.iterdir())
    else:
        assert code == 0, err
        assert (tmp_path / name).exists()


LONG_NAME = "a" * 300  # beyond the 255 bytes a file name may have: os.stat raises ENAMETOOLONG


@pytest.mark.parametrize(("argv", "said"), [
    (["export", "--placement", LONG_NAME, "--to", "sglang", "--out", "x.json"], "placement file"),
    (["solve", "--loads", LONG_NAME], "load file"),
    (["solve", "--out", f"{LONG_NAME}.json"], "--out"),
    (["cost", "--plot", f"{LONG_NAME}.png"], "--plot"),
])  # fmt: skip
def test_a_path_the_system_cannot_look_up_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str], said: str
) -> None:
    """A file name longer than the system takes was an OSError traceback (Path.is_dir raises ENAMETOOLONG) from every
    reader and writer checking its path (eplb.io.files.existing_file, output_file); now one line naming the flag or
    file, the name clipped with its length."""
    monkeypatch.chdir(tmp_path)
    code, err = run(capsys, *argv)
    assert code == 2 and err.startswith(error_prefix(argv) + f"{said} 'aaaa"), err
    assert "characters): the system cannot use this path (File name too long)" in err, err


@pytest.mark.parametrize(("argv", "said"), [
    (["synth", "--steps", "3", "--layers", "2", "--experts", "16", "--exponent", "1", "--out", f"{LONG_NAME}.npz"],
     "--out"),
    (["synth", "--preset", "seed004", "--steps", "2", "--layers", "2", "--out", f"{LONG_NAME}.npz"], "--out"),
    (["logs", "convert", "LOG", f"{LONG_NAME}.npz"], "OUT"),
    (["logs", "convert", "LOG", f"{LONG_NAME}.parquet"], "OUT"),
    (["logs", "convert", "LOG", f"{LONG_NAME}/log.jsonl"], "OUT"),
    (["replay", f"{LONG_NAME}.npz"], "routing log"),
    (["compare", "--log", f"{LONG_NAME}.npz", "--ep", "2", "--out", "r"], "routing log"),
    (["replay", "LOG", "--gpus", "4", "--out", LONG_NAME], "--out"),
    (["compare", "--log", "LOG", "--ep", "4", "--out", LONG_NAME], "--out"),
    (["compare", "--loads", "WINDOW", "--ep", "4", "--solvers", "greedy", "--out", f"{LONG_NAME}/r"], "--out"),
])  # fmt: skip
def test_a_log_or_report_path_the_system_cannot_look_up_is_refused_in_one_line(
    small: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    argv: list[str], said: str,
) -> None:
    """The readers and writers of logs and reports checked their paths by hand, and a name over 255 bytes was an
    OSError traceback (a94c1fd fixed the other files): eplb synth --out and eplb logs convert OUT (output_log),
    eplb replay LOG and compare --log (open_log), replay --out DIR and compare --out DIR (output_dir; compare's
    after every solve had run). Now one line naming the flag, the name clipped with its length, before the work."""
    monkeypatch.chdir(tmp_path)
    for name in ("compare_log", "compare_window"):  # compare's --out is checked before any solve
        monkeypatch.setattr(f"eplb.cli.compare.{name}", lambda *a, **k: pytest.fail("compare solved first"))
    args = [{"LOG": str(small["log"]), "WINDOW": str(small["window"])}.get(a, a) for a in argv]
    try:
        code = main(args)
    except SystemExit as exc:
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(error_prefix(argv) + f"{said} 'aaaa"), err
    assert "characters): the system cannot use this path (File name too long)" in err, err
    assert not list(tmp_path.iterdir())  # nothing made: no directory, no NAME.part


def test_the_log_and_report_functions_refuse_such_a_path_by_name(tmp_path: Path) -> None:
    """The Python API's readers and writers (open_log, write_counts through output_log, write_report) say the same
    line, naming what the path is."""
    from eplb.io.logs import write_counts
    from eplb.report import write_report

    long = tmp_path / LONG_NAME
    tail = r"characters\): the system cannot use this path \(File name too long\)"
    with pytest.raises(EplbError, match=f"routing log '.*{tail}"):
        open_log(f"{long}.npz")
    with pytest.raises(EplbError, match=f"log file '.*{tail}"):
        write_counts(f"{long}.npz", np.ones((2, 1, 4), np.int64))
    with pytest.raises(EplbError, match=f"report directory '.*{tail}"):
        write_report([], long, {})
    assert not list(tmp_path.iterdir())


def test_compare_refuses_an_out_it_cannot_write_before_any_solve(
    small: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """eplb compare --out under a file, or naming a file: refused before the solves (write_report's OSError came
    after all of them), and nothing made."""
    monkeypatch.setattr("eplb.cli.compare.compare_window", lambda *a, **k: pytest.fail("compare solved first"))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    compare = ["compare", "--loads", str(small["window"]), "--ep", "4", "--solvers", "greedy"]
    for out, said in ((a_file / "r", f"--out {a_file}/r: cannot write there ({a_file} is not a directory)"),
                      (a_file, f"--out {a_file}: exists and is not a directory")):
        code, err = run(capsys, *compare, "--out", str(out))
        assert code == 2 and err == f"eplb compare: error: {said}", err
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


@pytest.mark.parametrize(("name", "said"), [("a\nb.json", "a\\nb.json"), ("a\udcffb.json", "a\\xffb.json"),
                                            ("tab\there.json", "tab\\there.json")])
def test_an_error_naming_a_file_with_a_line_break_or_an_undecodable_byte_stays_one_line(
        name: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The name was printed raw: a line break split the error in two, an undecodable byte showed as '\\udcff'."""
    argv = ["solve", "--loads", str(tmp_path / name)]
    code, err = run_eplb(capsys, *argv)
    assert code == 2 and err == f"{error_prefix(argv)}load file not found: {tmp_path}/{said}\n"
