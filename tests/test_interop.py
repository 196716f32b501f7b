"""Interop: placements out to SGLang, TensorRT-LLM and vllm-ascend and back; their load statistics in."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import yaml
from numpy.typing import NDArray

from eplb.cli import interop as cli_interop
from eplb.errors import EplbError, FieldError
from eplb.io.exports import (
    checked_layer_ids,
    export_text,
    parse_layer_ids,
    to_sglang,
    to_trtllm,
    to_vllm_ascend,
    write_export,
)
from eplb.io.foreign import parse_placement, parse_trtllm_yaml, read_placement_any, read_placement_file
from eplb.io.statistics import (
    LOAD_FORMATS,
    fold_physical,
    import_loads,
    read_safetensors,
    read_sglang_loads,
    read_trtllm_loads,
    read_vllm_loads,
    write_loads,
)
from eplb.io.windows import read_window
from eplb.placement import Placement, save_placement

# Two MoE layers, 4 experts, 3 GPUs x 2 slots; experts 0/1 (layer 0) and 2/3 (layer 1) replicated.
PHY2LOG = [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 2, 3]]


def _placement() -> Placement:
    return Placement(np.array(PHY2LOG), np.array([2, 2, 2]), 4)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="eplb")
    sub = parser.add_subparsers(dest="command")
    cli_interop.register(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


# ---------------------------------------------------------------------------------------------- export


def test_sglang_export_fields_and_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "p.sglang.json"
    write_export(_placement(), "sglang", out, layer_ids=[3, 4], num_model_layers=6)
    data = json.loads(out.read_text())
    # SGLang passes every key to init_by_mapping(physical_to_logical_map=...): nothing else may be there.
    assert list(data) == ["physical_to_logical_map"]
    table = data["physical_to_logical_map"]
    assert len(table) == 6 and all(len(row) == 6 for row in table)  # [model layers][num_physical]
    assert table[3] == PHY2LOG[0] and table[4] == PHY2LOG[1]
    trivial = [s % 4 for s in range(6)]  # SGLang's init_trivial for layers no placement covers
    assert table[0] == table[1] == table[2] == table[5] == trivial
    back = read_placement_file(out, num_gpus=3, layer_ids=[3, 4])
    assert back.format == "sglang" and back.layer_ids == [3, 4]
    assert back.placement.phy2log.tolist() == PHY2LOG and back.placement.slots_per_gpu.tolist() == [2, 2, 2]


def test_sglang_rows_from_layer_ids_are_capped_as_the_flag_is(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--num-model-layers is capped at MAX_MODEL_LAYERS, but a placement with layer_ids [100000] exported a
    100,001-row SGLang file (and a larger id would allocate without bound): the row count is capped wherever it
    comes from."""
    from eplb.cli import main
    from eplb.io.exports import MAX_MODEL_LAYERS

    far = Placement(np.array([[0, 1, 2, 3]]), np.array([2, 2]), 4, layer_ids=(100_000,))
    with pytest.raises(EplbError, match=r"^SGLang's map has a row per model layer, and model layer 100000 would "
                       r"make it 100,001 rows, more than any model has \(at most 10,000\): check the placement's "
                       r"layer_ids$"):
        to_sglang(far)
    with pytest.raises(EplbError, match=r"and num_model_layers 10,001 would make it 10,001 rows"):
        to_sglang(_placement(), num_model_layers=MAX_MODEL_LAYERS + 1)
    save_placement(far, tmp_path / "far.json")
    assert main(["export", "--placement", str(tmp_path / "far.json"), "--to", "sglang",
                 "--out", str(tmp_path / "far.sglang.json")]) == 2  # fmt: skip
    assert "would make it 100,001 rows" in capsys.readouterr().err and not (tmp_path / "far.sglang.json").exists()
    near = Placement(np.array([[0, 1, 2, 3]]), np.array([2, 2]), 4, layer_ids=(MAX_MODEL_LAYERS - 1,))
    assert len(to_sglang(near)["physical_to_logical_map"]) == MAX_MODEL_LAYERS


def test_sglang_default_rows_and_file_name(tmp_path: Path) -> None:
    assert to_sglang(_placement())["physical_to_logical_map"] == PHY2LOG
    with pytest.raises(EplbError, match=r"ends in \.json"):
        write_export(_placement(), "sglang", tmp_path / "p.txt")
    write_export(_placement(), "sglang", tmp_path / "p.json")
    with pytest.raises(EplbError, match=r"do not record the EP size; pass the GPU count \(--gpus\)"):
        read_placement_any(tmp_path / "p.json")
    with pytest.raises(EplbError, match="do not split evenly over 4 GPUs"):
        read_placement_any(tmp_path / "p.json", num_gpus=4)


def test_trtllm_export_fields_and_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "moe_load_balancer.yaml"
    write_export(_placement(), "trtllm", out, layer_ids=[3, 4])
    text = out.read_text()
    data = parse_trtllm_yaml(text)
    # MoeLoadBalancerConfig forbids extra keys.
    assert set(data) == {"num_slots", "initial_global_assignments", "layer_updates_per_iter"}
    assert data["num_slots"] == 6 and data["layer_updates_per_iter"] == 0
    assert data["initial_global_assignments"] == {3: PHY2LOG[0], 4: PHY2LOG[1]}
    assert all(len(row) == data["num_slots"] for row in data["initial_global_assignments"].values())
    assert to_trtllm(_placement(), [3, 4]) == data
    back = read_placement_file(out, num_gpus=3)
    assert back.format == "trtllm" and back.layer_ids == [3, 4] and back.placement.phy2log.tolist() == PHY2LOG
    assert read_placement_any(out, num_gpus=3, layer_ids=[4]).phy2log.tolist() == [PHY2LOG[1]]
    with pytest.raises(EplbError, match="no row for layer 5"):
        read_placement_any(out, num_gpus=3, layer_ids=[5])


def test_trtllm_yaml_is_real_yaml(tmp_path: Path) -> None:
    text = export_text(_placement(), "trtllm", layer_ids=[3, 4])
    assert yaml.safe_load(text) == parse_trtllm_yaml(text)


def test_trtllm_yaml_layouts() -> None:
    block = "num_slots: 6\nlayer_updates_per_iter: 0\ninitial_global_assignments:\n  3:\n  - 0\n  - 1\n  - 2\n" \
            "  - 3\n  - 0\n  - 1\n"
    assert parse_trtllm_yaml(block)["initial_global_assignments"] == {3: PHY2LOG[0]}
    wrapped = "initial_global_assignments:\n  7: [0, 1, 2,\n      3, 0, 1]  # slots\nnum_slots: 6\n"
    assert parse_trtllm_yaml(wrapped) == {"initial_global_assignments": {7: PHY2LOG[0]}, "num_slots": 6}
    online = parse_trtllm_yaml("num_slots: 288\nlayer_updates_per_iter: 2\n")
    with pytest.raises(EplbError, match="no initial_global_assignments"):
        parse_placement(online, num_gpus=36)


def test_vllm_ascend_export_fields_and_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "expert_map.json"
    write_export(_placement(), "vllm-ascend", out)
    data = json.loads(out.read_text())
    assert data["moe_layer_count"] == 2 and len(data["layer_list"]) == 2
    for i, layer in enumerate(data["layer_list"]):
        assert set(layer) == {"layer_id", "device_count", "device_list"}
        assert layer["layer_id"] == i and layer["device_count"] == 3 and len(layer["device_list"]) == 3
        for g, device in enumerate(layer["device_list"]):
            assert device == {"device_id": g, "device_expert": PHY2LOG[i][2 * g : 2 * g + 2]}
    # vllm-ascend's loader stacks device_expert into a [layers, devices, slots] tensor.
    tensor = np.array([[d["device_expert"] for d in layer["device_list"]] for layer in data["layer_list"]])
    assert tensor.shape == (2, 3, 2) and tensor.reshape(2, 6).tolist() == PHY2LOG
    assert to_vllm_ascend(_placement()) == data
    back = read_placement_file(out)
    assert back.format == "vllm-ascend" and back.placement.phy2log.tolist() == PHY2LOG


def test_json_export_keeps_shares_and_layer_ids(tmp_path: Path) -> None:
    p = Placement(np.array([[0, 1, 1, 2]]), np.array([3, 1]), 3, np.array([[1, 0.3, 0.7, 1]]))
    write_export(p, "json", tmp_path / "p.json", layer_ids=[5])
    back = read_placement_file(tmp_path / "p.json")
    assert back.format == "json" and back.layer_ids == [5]
    assert back.placement.phy2log.tolist() == [[0, 1, 1, 2]] and back.placement.slots_per_gpu.tolist() == [3, 1]
    assert back.placement.shares is not None and np.allclose(back.placement.shares, [[1, 0.3, 0.7, 1]])


@pytest.mark.parametrize("target", ["sglang", "trtllm", "vllm-ascend"])
def test_unequal_slots_refused_with_fix(target: str) -> None:
    # 28 GPUs x 9 slots, but GPU 0 has 8 and GPU 1 has 10: 252 slots, 200 experts.
    slots = np.array([8, 10] + [9] * 26)
    phy2log = np.arange(int(slots.sum()))[None, :] % 200
    p = Placement(phy2log, slots, 200)
    with pytest.raises(EplbError, match=r"same number of slots on every GPU.*has 8-10 per GPU.*--slots-per-gpu 9"):
        export_text(p, target)
    assert json.loads(export_text(p, "json"))["slots_per_gpu"][:2] == [8, 10]


@pytest.mark.parametrize("target", ["sglang", "trtllm", "vllm-ascend"])
def test_weighted_shares_refused(target: str) -> None:
    weighted = Placement(np.array([PHY2LOG[0]]), np.array([2, 2, 2]), 4, np.array([[0.7, 0.5, 1, 1, 0.3, 0.5]]))
    with pytest.raises(EplbError, match=r"weighted shares \(layer 0, slot 0 serves 0.7 of expert 0's tokens, not 0.5"):
        export_text(weighted, target)
    uniform = Placement(np.array([PHY2LOG[0]]), np.array([2, 2, 2]), 4, np.array([[0.5, 0.5, 1, 1, 0.5, 0.5]]))
    export_text(uniform, target)  # uniform shares spelled out are fine


def test_vllm_ascend_refuses_two_copies_on_one_gpu() -> None:
    p = Placement(np.array([[0, 0, 1, 2, 3, 1]]), np.array([2, 2, 2]), 4)
    with pytest.raises(EplbError, match="GPU 0 holds expert 0 twice in layer 0"):
        export_text(p, "vllm-ascend")
    export_text(p, "sglang")


def test_layer_ids() -> None:
    assert parse_layer_ids("3-5,9") == [3, 4, 5, 9]
    with pytest.raises(EplbError, match="runs backwards"):
        parse_layer_ids("5-3")
    with pytest.raises(EplbError, match="more than the placement's 2 layers"):  # before expanding the range
        parse_layer_ids("0-99999999", max_count=2)
    with pytest.raises(EplbError, match="layer 61 is beyond the model's 61 layers"):
        parse_layer_ids("3,61", num_model_layers=61)
    with pytest.raises(FieldError, match="layer -1 is negative") as negative:
        checked_layer_ids([-1, 3], 2)
    assert negative.value.fields == ("layer_ids",)
    with pytest.raises(EplbError, match="1 id for the placement's 2 layers"):
        to_trtllm(_placement(), [3])
    with pytest.raises(EplbError, match="layer 3 appears twice"):
        to_trtllm(_placement(), [3, 3])
    with pytest.raises(EplbError, match="num_model_layers is 4 but layer id 4"):
        to_sglang(_placement(), [3, 4], num_model_layers=4)


def test_placement_detection_errors(tmp_path: Path) -> None:
    (tmp_path / "loads.json").write_text('{"logical_count": [[1, 2]]}')
    with pytest.raises(EplbError, match="load statistics file, not a placement"):
        read_placement_any(tmp_path / "loads.json")
    (tmp_path / "other.json").write_text('{"foo": 1}')
    with pytest.raises(EplbError, match="not a placement file I know"):
        read_placement_any(tmp_path / "other.json")
    (tmp_path / "bad.yaml").write_text("initial_global_assignments:\n  3: [0, x]\n")
    with pytest.raises(EplbError, match=r"bad\.yaml"):
        read_placement_any(tmp_path / "bad.yaml", num_gpus=1)
    with pytest.raises(EplbError, match="not found"):
        read_placement_any(tmp_path / "missing.json")


def test_export_of_a_placement_that_is_no_file_says_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eplb export --placement /dev/null` said 'placement file not found': it exists. Each path says what is wrong
    with it: a device or a pipe is no regular file, an empty file is empty, a directory a directory, a symbolic link
    to nothing broken, a JSON file of something else no placement."""
    from eplb.cli import main

    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "broken").symlink_to(tmp_path / "gone.json")
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "other.json").write_text('{"foo": 1}')
    for path, said in (
        ("/dev/null", "placement file /dev/null exists but is not a regular file (a character device); give a file"),
        (tmp_path / "pipe", f"placement file {tmp_path / 'pipe'} exists but is not a regular file (a named pipe)"),
        (tmp_path / "empty.json", f"placement file {tmp_path / 'empty.json'} is empty (0 bytes)"),
        (tmp_path, f"placement file {tmp_path} is a directory; give a file"),
        (tmp_path / "broken", f"placement file not found: {tmp_path / 'broken'} (a broken symbolic link)"),
        (tmp_path / "missing.json", f"placement file not found: {tmp_path / 'missing.json'}\n"),
        (tmp_path / "other.json", "not a placement file I know"),
    ):
        assert main(["export", "--placement", str(path), "--to", "sglang", "--out", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("eplb export: error: ") and said in err, (path, err)
    assert not (tmp_path / "x.json").exists()


def test_an_expert_id_beyond_the_loads_experts_is_named(tmp_path: Path) -> None:
    """SGLang, TensorRT-LLM and vllm-ascend files do not record E, so it was their largest id + 1: a map
    [[0, 1, 2, 9]] read for a 4-expert window said 'logical expert 3 has no replica ... (6 missing in all)'."""
    from eplb.io.foreign import read_placement_for

    files = {
        "sg.json": {"physical_to_logical_map": [[0, 1, 2, 9]]},
        "trt.yaml": {"num_slots": 4, "initial_global_assignments": {0: [0, 1, 2, 9]}},
        "asc.json": {"moe_layer_count": 1, "layer_list": [{"layer_id": 0, "device_count": 2, "device_list": [
            {"device_id": 0, "device_expert": [0, 1]}, {"device_id": 1, "device_expert": [2, 9]}]}]},
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
        with pytest.raises(EplbError, match=r": row 0, slot 3: expert id 9 is outside 0\.\.3 \(the loads have 4 "
                           r"experts\); give the placement made for these loads$"):
            read_placement_for(tmp_path / name, 1, 4, num_gpus=2)
    (tmp_path / "six.json").write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 3, 4, 5]]}))
    with pytest.raises(EplbError, match=r"the placement is 1 layer x 6 slots of 6 experts but the loads are 1 layer "
                       r"x 4 experts"):  # a whole placement of more experts: another model's, said as such
        read_placement_for(tmp_path / "six.json", 1, 4, num_gpus=2)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"device_count": 3}, r"layer_list\[0\] says device_count 3 but its device_list has 2 devices"),
        ({"devices": [1, 1]}, r"layer_list\[0\]: device_id 1 appears twice \(device_list\[0\] and \[1\]\)"),
        ({"devices": [1, 0]}, r"layer_list\[0\]\.device_list\[0\] has device_id 1: vllm-ascend takes the devices in "
                              r"list order, so entry 0 is device 0"),
        ({"layer_id": 5}, r"layer_list\[0\] has layer_id 5: vllm-ascend takes the layers in list order"),
    ],
)
def test_an_inconsistent_vllm_ascend_map_is_refused(tmp_path: Path, edit: dict[str, Any], message: str) -> None:
    """vllm-ascend reads layers and devices by position, ignoring layer_id, device_count and device_id: a map whose
    device_count is 3 with 2 devices listed, or with a device_id twice, was read as if they agreed."""
    layer: dict[str, Any] = {"layer_id": edit.get("layer_id", 0), "device_count": edit.get("device_count", 2),
                             "device_list": [{"device_id": g, "device_expert": experts} for g, experts in
                                             zip(edit.get("devices", [0, 1]), ([0, 1], [2, 3]), strict=True)]}
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"moe_layer_count": 1, "layer_list": [layer]}))
    with pytest.raises(EplbError, match=f"^{re.escape(str(path))}: {message}"):
        read_placement_file(path)
    del layer["layer_id"]  # optional, as the device_ids: positions say the same (device_count vllm-ascend reads)
    layer["device_count"] = 2
    for device in layer["device_list"]:
        del device["device_id"]
    path.write_text(json.dumps({"moe_layer_count": 1, "layer_list": [layer]}))
    assert read_placement_file(path).placement.phy2log.tolist() == [[0, 1, 2, 3]]


def test_a_routing_log_or_window_given_as_a_placement_is_named(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """eplb evaluate --placement small.npz (a routing log) said "not a readable text file ('utf-8' codec ...)"."""
    from eplb.cli import main
    from eplb.io.logs import write_counts

    (tmp_path / "w.json").write_text(json.dumps({"loads": [[1, 2, 3, 4]]}))
    write_counts(tmp_path / "log.npz", np.ones((2, 1, 4), dtype=np.int64))
    np.savez(tmp_path / "tk.npz", topk_ids=np.zeros((2, 1, 1), dtype=np.int16), step_offsets=np.array([0, 2]),
             num_experts=np.int64(4))
    np.savez(tmp_path / "loads.npz", loads=np.ones((1, 4)))
    np.save(tmp_path / "w.npy", np.ones((1, 4)))
    (tmp_path / "junk.bin").write_bytes(b"\xff\xfe\x00 not text")
    tail = "placements are JSON or YAML text (eplb's, SGLang's, TensorRT-LLM's or vllm-ascend's)"
    for name, said in (("log.npz", "a routing log (per-step counts)"), ("tk.npz", "a token-level routing log"),
                       ("loads.npz", "a load window (loads)"), ("w.npy", "a numpy array (.npy)"),
                       ("junk.bin", "not a readable text file")):
        assert main(["evaluate", "--loads", str(tmp_path / "w.json"), "--placement", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"eplb evaluate: error: {tmp_path / name}: {said}"), err
        assert (f"not a placement: give it as --loads (or to eplb replay); {tail}" in err) == (name != "junk.bin")
    from eplb.io.parquet import write_parquet

    write_parquet(tmp_path / "log.parquet", np.ones((2, 1, 4), dtype=np.int64))
    shard = next((tmp_path / "log.parquet").iterdir())
    assert main(["evaluate", "--loads", str(tmp_path / "w.json"), "--placement", str(shard)]) == 2
    err = capsys.readouterr().err
    assert f"a Parquet shard of a routing log, not a placement: give it to eplb replay; {tail}" in err


def test_empty_slots_read_and_export(tmp_path: Path) -> None:
    """vLLM marks slots of absent ranks with -1: our files and SGLang-style maps keep them; only eplb's own
    format can carry them out, the serving systems' formats need an expert in every slot."""
    table = [[0, 1, 2, 3, -1, -1], [3, 2, 1, 0, -1, -1]]
    (tmp_path / "vllm_map.json").write_text(json.dumps({"physical_to_logical_map": table}))
    foreign = read_placement_any(tmp_path / "vllm_map.json", num_gpus=3)
    assert foreign.empty_slots.sum() == 4 and foreign.replicas.tolist() == [[1, 1, 1, 1]] * 2
    assert json.loads(export_text(foreign, "json"))["phy2log"] == table
    for target in ("sglang", "trtllm", "vllm-ascend"):
        with pytest.raises(EplbError, match=r"slot 4 of layer 0 is empty \(-1\) and GPU 2 holds no expert \(a rank "
                           r"absent while EP scales\); re-solve for the GPUs that serve, or export --to json"):
            export_text(foreign, target)
    (tmp_path / "neg.json").write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 3, -2, -1]]}))
    with pytest.raises(EplbError, match=r"or -1 for an empty slot"):
        read_placement_any(tmp_path / "neg.json", num_gpus=3)


def test_empty_slots_on_gpus_that_serve_are_said_for_what_they_are(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--objective time leaves redundant slots empty on GPUs that serve (one slot per expert, on decode): the
    export said 're-solve for the GPUs that serve', which is about absent ranks, then assumed --objective time
    had left them so; it says what the slots are and how to get a placement without them."""
    from eplb.cli import main

    placement, out = tmp_path / "time.json", tmp_path / "time.sglang.json"
    decode = Path(__file__).resolve().parents[1] / "fixtures" / "sglang6017-dsv3-decode-in1000out1000.json"
    assert main(["solve", "--loads", str(decode), "--objective", "time", "--tokens-per-gpu", "64",
                 "--out", str(placement)]) == 0  # fmt: skip
    assert "one slot per expert" in capsys.readouterr().out
    for target in ("sglang", "trtllm", "vllm-ascend"):
        named = out.with_name("time.yaml") if target == "trtllm" else out  # TensorRT-LLM's file is YAML
        assert main(["export", "--placement", str(placement), "--to", target, "--out", str(named)]) == 2
        system = {"sglang": "SGLang", "trtllm": "TensorRT-LLM", "vllm-ascend": "vllm-ascend"}[target]
        err = capsys.readouterr().err
        assert err.startswith(
            f"eplb export: error: {system} loads an expert into every slot, but slot 8 of layer 0 is empty (-1: no "
            "expert's weights, no tokens) on GPU 0, which holds experts in its other slots (") and err.endswith(
            f" empty slots in all); {system} cannot take empty slots: solve with every slot filled (eplb solve "
            "--objective lb, the default, fills them), or export --to json to keep them\n"), err
        assert "--objective time" not in err  # what the slots are, not a guess at what left them empty
    assert main(["solve", "--loads", str(decode), "--out", str(placement)]) == 0  # as it says: every slot filled
    assert main(["export", "--placement", str(placement), "--to", "sglang", "--out", str(out)]) == 0


def test_library_exports_write_the_placements_own_layer_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A placement file of `eplb solve` carries layer_ids 3..60: `eplb export` wrote SGLang's 61 rows and
    TensorRT-LLM's keys 3..60, but export_text(load_placement(f), ...) 58 rows and keys 0..57 (the placement
    dropped the ids). Both take them from the placement now, and write the same files."""
    from eplb.cli import main
    from eplb.placement import load_placement

    solved = tmp_path / "p.json"
    assert main(["solve", "--gpus", "32", "--slots-per-gpu", "9", "--out", str(solved)]) == 0
    p = load_placement(solved)
    rows = json.loads(export_text(p, "sglang"))["physical_to_logical_map"]
    assert len(rows) == 61 and rows[3:] == p.phy2log.tolist()
    assert list(parse_trtllm_yaml(export_text(p, "trtllm"))["initial_global_assignments"]) == list(range(3, 61))
    assert json.loads(export_text(p, "json"))["layer_ids"] == list(range(3, 61))
    for target, name in (("sglang", "p.sglang.json"), ("trtllm", "p.yaml"), ("json", "p.out.json")):
        assert main(["export", "--placement", str(solved), "--to", target, "--out", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_text() == export_text(p, target), target
    assert export_text(p, "trtllm", layer_ids=range(3, 61)) == export_text(p, "trtllm")  # the same ids: fine
    with pytest.raises(FieldError, match=r"^layer_ids: 0-57 given, but the placement's rows are model layers 3-60"):
        export_text(p, "sglang", layer_ids=range(58))
    bare = Placement(p.phy2log, p.slots_per_gpu, p.num_experts)  # no ids: the rows are layers 0..57, as before
    assert len(json.loads(export_text(bare, "sglang"))["physical_to_logical_map"]) == 58
    assert json.loads(export_text(bare, "json", layer_ids=range(3, 61)))["layer_ids"] == list(range(3, 61))
    with pytest.raises(FieldError, match="layer 3 comes after layer 4"):  # written as the field: in model order
        export_text(_placement(), "json", layer_ids=[4, 3])
    assert to_trtllm(_placement(), [4, 3])["initial_global_assignments"] == {4: PHY2LOG[0], 3: PHY2LOG[1]}


def test_a_gpu_count_other_than_the_files_own_is_refused_by_the_library(tmp_path: Path) -> None:
    """read_placement_any("out.vllm-ascend.json", num_gpus=16) returned the file's 32 GPUs (our JSON too); only
    the CLI refused it. One check refuses it for every reader, naming the parameter (the CLI: --gpus)."""
    save_placement(_placement(), tmp_path / "p.json")  # 3 GPUs
    write_export(_placement(), "vllm-ascend", tmp_path / "p.vllm-ascend.json")
    for name in ("p.json", "p.vllm-ascend.json"):
        path = tmp_path / name
        said = (f"num_gpus 16: {path} records its own GPU count, 3: give 3, or a placement for 16 GPUs (only "
                "SGLang and TensorRT-LLM files, which do not record it, need num_gpus to be read)")
        for read in (read_placement_any, read_placement_file):
            with pytest.raises(EplbError) as refused:
                read(path, num_gpus=16)
            assert str(refused.value) == said
        assert read_placement_any(path, num_gpus=3).num_gpus == 3 and read_placement_any(path).num_gpus == 3
        with pytest.raises(EplbError, match=r"^num_gpus 16: placement records its own GPU count, 3"):
            parse_placement(json.loads(path.read_text()), source="placement", num_gpus=16)
        with pytest.raises(EplbError, match=r"^--gpus 16: .* need --gpus to be read\)$"):
            _cli(["export", "--placement", str(path), "--gpus", "16", "--to", "json", "--out",
                  str(tmp_path / "o.json")])


def test_export_says_which_moe_layers_the_engine_will_not_find(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    """`--layer-ids 3-59` of a DeepSeek-V3 placement wrote a 60-row SGLang map (SGLang expects all 61 layers) and a
    TensorRT-LLM config without layer 60 (TensorRT-LLM raises KeyError), silently; `--num-model-layers 70` was taken
    for the 61-layer model. A placement of a preset's experts and layers gets a warning line for each (the export is
    still written), and the model's row count; --num-model-layers below a layer id is refused naming the flag."""
    from eplb.cli import main

    solved = tmp_path / "p.json"
    assert main(["solve", "--gpus", "32", "--slots-per-gpu", "9", "--out", str(solved)]) == 0
    base = ["export", "--placement", str(solved), "--out"]
    capsys.readouterr()
    assert main([*base, str(tmp_path / "s.json"), "--to", "sglang", "--layer-ids", "3-59"]) == 0
    assert len(json.loads((tmp_path / "s.json").read_text())["physical_to_logical_map"]) == 61
    out = capsys.readouterr()
    assert out.err == ("warning: SGLang will look for deepseek-v3's MoE layer 60 and not find it in this placement "
                       "(its rows are model layers 3-59): its row gets SGLang's trivial map (slot s holds expert s mod "
                       "E); export every MoE layer (3-60)\n")
    assert "61 model layers x 288 physical experts" in out.out
    assert main([*base, str(tmp_path / "t.yaml"), "--to", "trtllm", "--layer-ids", "3-59"]) == 0
    assert "TensorRT-LLM will look for deepseek-v3's MoE layer 60 and not find it in this placement (its rows are " \
           "model layers 3-59): it raises KeyError at start-up" in capsys.readouterr().err
    assert main([*base, str(tmp_path / "a.json"), "--to", "vllm-ascend", "--layer-ids", "4-60"]) == 0
    err = capsys.readouterr().err
    assert "vllm-ascend takes the rows in order as deepseek-v3's MoE layers (model layers 3-59), but they are model " \
           "layers 4-60" in err and "vllm-ascend will look for deepseek-v3's MoE layer 60 and not find it" in err
    assert main([*base, str(tmp_path / "s.json"), "--to", "sglang", "--num-model-layers", "70"]) == 0
    assert capsys.readouterr().err == ("warning: --num-model-layers 70: deepseek-v3 has 61 layers and SGLang expects "
                                       "one row for each\n")
    for target, name in (("sglang", "s.json"), ("trtllm", "t.yaml"), ("vllm-ascend", "a.json"), ("json", "j.json")):
        assert main([*base, str(tmp_path / name), "--to", target]) == 0  # the whole model: nothing to say
        assert capsys.readouterr().err == "", target
    (tmp_path / "s.json").unlink()
    assert main([*base, str(tmp_path / "s.json"), "--to", "sglang", "--num-model-layers", "60"]) == 2
    assert capsys.readouterr().err == ("eplb export: error: --num-model-layers is 60 but layer id 60 needs at least "
                                       "61 rows (model layers 0-60): give at least 61, or --layer-ids that fit\n")
    assert not (tmp_path / "s.json").exists()
    assert main([*base, str(tmp_path / "s.json"), "--to", "sglang", "--layer-ids", "5,3"]) == 2
    assert "--layer-ids: layer 3 comes after layer 5" in capsys.readouterr().err
    save_placement(_placement(), tmp_path / "small.json")  # 2 layers of 4 experts: no preset, no warning
    assert main(["export", "--placement", str(tmp_path / "small.json"), "--to", "trtllm", "--layer-ids", "3-4",
                 "--out", str(tmp_path / "t.yaml")]) == 0
    assert capsys.readouterr().err == ""


def test_a_json_export_says_what_the_file_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A vllm-ascend expert map back to eplb's JSON printed 'placement layers -> model layers 0-57', though the file
    it wrote holds no layer_ids (vllm-ascend numbers MoE layers by position): the summary says what the file holds."""
    placement = Placement(np.array([[0, 1, 2, 3]] * 3), np.array([2, 2]), 4, layer_ids=(3, 4, 5))
    save_placement(placement, tmp_path / "p.json")
    ascend, back = tmp_path / "expert_map.json", tmp_path / "back.json"
    assert _cli(["export", "--placement", str(tmp_path / "p.json"), "--to", "vllm-ascend", "--out", str(ascend)]) == 0
    capsys.readouterr()
    assert _cli(["export", "--placement", str(ascend), "--to", "json", "--out", str(back)]) == 0
    assert capsys.readouterr().out == (f"wrote {back}: eplb placement, 3 layers (no layer_ids: rows by position, no "
                                       "model layer named; --layer-ids to record them), 2 GPUs, 4 slots\n")
    assert "layer_ids" not in json.loads(back.read_text())
    assert _cli(["export", "--placement", str(ascend), "--to", "json", "--out", str(back), "--layer-ids", "3-5"]) == 0
    assert "3 layers (layer_ids: model layers 3-5), 2 GPUs" in capsys.readouterr().out
    assert json.loads(back.read_text())["layer_ids"] == [3, 4, 5]


def test_export_summaries_count_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """'1 model layers', '1 MoE layers', '1 slots', '1 ranks': the summaries of a one-layer, one-GPU placement."""
    save_placement(Placement(np.array([[0, 1]]), np.array([2]), 2), tmp_path / "one.json")
    said = {
        "sglang": "SGLang expert location, 1 model layer x 2 physical experts (placement layer -> model layer 0; ",
        "trtllm": "num_slots 2 (2 slots per rank on 1 rank; placement layer -> model layer 0; ",
        "vllm-ascend": "vllm-ascend expert map, 1 MoE layer x 1 device x 2 slots\nserve on 1 device with",
        "json": "eplb placement, 1 layer (no layer_ids: rows by position, no model layer named; --layer-ids to "
                "record them), 1 GPU, 2 slots",
    }
    for target, text in said.items():
        out = tmp_path / f"o.{target}.{'yaml' if target == 'trtllm' else 'json'}"
        assert _cli(["export", "--placement", str(tmp_path / "one.json"), "--to", target, "--out", str(out)]) == 0
        assert text in capsys.readouterr().out, target
    save_placement(Placement(np.array([[0]]), np.array([1]), 1), tmp_path / "single.json")
    assert _cli(["export", "--placement", str(tmp_path / "single.json"), "--to", "trtllm", "--out",
                 str(tmp_path / "s.yaml")]) == 0
    assert "num_slots 1 (1 slot per rank on 1 rank;" in capsys.readouterr().out
    one = tmp_path / "one_layer.json"  # an SGLang dump of one layer of one expert: '1 layer ... x 1 expert'
    one.write_text(json.dumps({"logical_count": [[[0], [7]]]}))
    assert _cli(["import-load", "--from", "sglang", str(one), "--out", str(tmp_path / "w.json")]) == 0
    assert ": 1 layer (model layer 1) x 1 expert, 7 token-expert" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- loads in


def test_sglang_stat_dump_json_drops_dense_layers(tmp_path: Path) -> None:
    dense, moe1, moe2 = [0, 0, 0], [5, 1, 0], [2, 2, 2]
    two_steps = [[dense, moe1, moe2], [dense, moe1, moe2]]
    (tmp_path / "a.json").write_text(json.dumps({"rank": 0, "logical_count": two_steps}))
    (tmp_path / "b.json").write_text(json.dumps({"logical_count": [dense, moe1, moe2]}))  # [layers, E]
    loads = read_sglang_loads([tmp_path / "a.json", tmp_path / "b.json"])
    assert loads.counts.shape == (3, 2, 3) and loads.layer_ids == [1, 2]
    assert loads.window.tolist() == [[15, 3, 0], [6, 6, 6]]
    kept = read_sglang_loads([tmp_path / "b.json"], drop_empty_layers=False)
    assert kept.layer_ids == [0, 1, 2] and kept.window.shape == (3, 3)


def test_sglang_npz_and_refusals(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", logical_count=np.array([[[1, 2], [3, 4]]]))
    assert read_sglang_loads([tmp_path / "d.npz"]).window.tolist() == [[1, 2], [3, 4]]
    (tmp_path / "d.pt").write_bytes(b"PK")
    with pytest.raises(EplbError, match=r"need torch.*numpy\.savez"):
        read_sglang_loads([tmp_path / "d.pt"])
    cases = {
        "nokey.json": ({"rank": 0}, "missing 'logical_count'"),
        "neg.json": ({"logical_count": [[1, 2], [3, -4]]},
                     r"logical_count\[0\]\[1\]\[1\]: count is -4; counts must be >= 0"),
        "ragged.json": ({"logical_count": [[1, 2], [3]]}, "ragged: row 0 has 2 entries, row 1 has 1"),
        "flat.json": ({"logical_count": [1, 2]}, r"must be \[steps\]\[layers\]\[experts\] or \[layers\]\[experts\]"),
        "zero.json": ({"logical_count": [[0, 0]]}, "every count is 0"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        with pytest.raises(EplbError, match=message):
            read_sglang_loads([tmp_path / name])
    np.savez(tmp_path / "two.npz", logical_count=np.ones((1, 2, 2)))
    (tmp_path / "three.json").write_text(json.dumps({"logical_count": [[1, 1, 1], [1, 1, 1]]}))
    with pytest.raises(EplbError, match=r"three\.json has 2 layers x 3 experts but two\.npz has 2 x 2"):
        read_sglang_loads([tmp_path / "two.npz", tmp_path / "three.json"])



def test_numbers_beyond_ids_and_token_counts_are_named(tmp_path: Path) -> None:
    """Integers read through float64: an id beyond 2**53 is refused by name, not wrapped to a negative id; a
    count above the windows' limit (1e15), or an integer beyond float range, is refused where it is read."""
    for big, shown in ((2**70, "1.1805916207174113e+21"), (10**400, "more than 1.8e+308")):
        table = [[0, 1, 2, 3] * 2, [0, big, 2, 3] * 2]
        with pytest.raises(EplbError) as info:
            parse_placement({"physical_to_logical_map": table}, source="sg.json", num_gpus=2)
        assert str(info.value) == f"sg.json: physical_to_logical_map[1][1] is {shown}: too large for an expert id"
        (tmp_path / "c.json").write_text(json.dumps({"logical_count": [[1, 2], [3, big]]}))
        with pytest.raises(EplbError) as info:
            read_sglang_loads([tmp_path / "c.json"])
        assert str(info.value) == (f"{tmp_path / 'c.json'}: logical_count[0][1][1]: count is {shown}, too large for "
                                   "a token count (at most 1e+15)")


@pytest.mark.parametrize(("value", "why"), [(3.5, "3.5; counts must be whole numbers"), (-2, "-2; counts must be >= 0"),
                                           (float("nan"), "nan; counts must be finite"),
                                           (float("inf"), "inf; counts must be finite")])
def test_imported_counts_are_token_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: float, why: str
) -> None:
    """SGLang, TensorRT-LLM and vLLM dumps count tokens: a fraction (3.5 was summed into the window by --from sglang
    and trtllm, and vllm), a negative, NaN or inf means a wrong file, refused in one line naming the file, the key
    or field, and the entry: the routing logs' rule (`count_problem`), one check for the three."""
    from eplb.cli import main

    steps = [[[1, 2, 3, 4], [1, value, 3, 4]]]  # NaN and inf as Python's json writes them (NaN, Infinity)
    (tmp_path / "sg.json").write_text(json.dumps({"logical_count": steps}))
    (tmp_path / "vllm.json").write_text(json.dumps({"counts": steps}))
    trtllm = tmp_path / "stats"
    trtllm.mkdir()
    (trtllm / "meta_info.json").write_text(json.dumps({"num_experts": 4, "num_experts_per_token": 2}))
    (trtllm / "rank0.json").write_text(json.dumps({"0_3": steps[0][0], "0_4": steps[0][1]}))
    for fmt, given, where in (("sglang", tmp_path / "sg.json", "logical_count[0][1][1]"),
                              ("vllm", tmp_path / "vllm.json", "counts[0][1][1]"),
                              ("trtllm", trtllm, "0_4[1]")):
        file = trtllm / "rank0.json" if fmt == "trtllm" else given
        assert main(["import-load", "--from", fmt, str(given), "--out", str(tmp_path / "w.json")]) == 2, fmt
        err = capsys.readouterr().err
        assert err == f"eplb import-load: error: {file}: {where}: count is {why}\n", fmt
    assert not (tmp_path / "w.json").exists()


def test_import_load_names_its_input_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing, empty or unusable input was 'file not found: x' (no word of which argument), a directory named
    rank0.json in a TensorRT-LLM folder an IsADirectoryError traceback, and a name too long for the system an
    OSError one: each is one line naming the statistics file, as solve names its load file (`existing_file`)."""
    from eplb.cli import main

    def error(fmt: str, *files: Path | str) -> str:
        assert main(["import-load", "--from", fmt, *map(str, files), "--out", str(tmp_path / "w.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        return err.strip().removeprefix("eplb import-load: error: ")

    missing, empty = tmp_path / "missing.json", tmp_path / "empty.json"
    empty.write_text("")
    for fmt in LOAD_FORMATS:
        assert error(fmt, missing) == f"statistics file not found: {missing}", fmt
    for fmt in ("sglang", "vllm"):
        assert error(fmt, empty) == f"statistics file {empty} is empty (0 bytes)", fmt
    folder, _ = _trtllm_dir(tmp_path, "json")
    assert error("trtllm", folder / "meta_info.json", missing) == f"statistics file not found: {missing}"
    (folder / "rank5.json").mkdir()
    assert error("trtllm", folder) == f"statistics file {folder / 'rank5.json'} is a directory; give a file"
    assert error("trtllm", "x" * 300).startswith("statistics file 'xxx")
    assert not (tmp_path / "w.json").exists()


def _trtllm_dir(tmp_path: Path, fmt: str = "safetensors") -> tuple[Path, NDArray[np.float64]]:
    folder = tmp_path / "expert_statistic"
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": 4, "num_experts_per_token": 2}))
    rng = np.random.default_rng(7)
    expected = np.zeros((3, 2, 4))
    for rank in range(2):
        records = {}
        for i, it in enumerate((100, 101, 102)):
            for j, layer in enumerate((3, 4)):
                counts = rng.integers(0, 20, size=4).astype(np.int64)
                expected[i, j] += counts
                records[f"{it}_{layer}"] = counts
        if fmt == "safetensors":
            safetensors.numpy.save_file(records, str(folder / f"rank{rank}.safetensors"))
        else:
            (folder / f"rank{rank}.json").write_text(json.dumps({k: v.tolist() for k, v in records.items()}))
    return folder, expected


@pytest.mark.parametrize("fmt", ["safetensors", "json"])
def test_trtllm_statistics(tmp_path: Path, fmt: str) -> None:
    folder, expected = _trtllm_dir(tmp_path, fmt)
    loads = read_trtllm_loads([folder])
    assert loads.layer_ids == [3, 4] and np.array_equal(loads.counts, expected)
    assert loads.meta["num_experts_per_token"] == 2 and loads.meta["iterations"] == [100, 103]
    files = sorted(folder.iterdir())
    assert np.array_equal(read_trtllm_loads(files).counts, expected)  # meta_info.json + rank files by name


def test_trtllm_statistics_errors(tmp_path: Path) -> None:
    folder, _ = _trtllm_dir(tmp_path, "json")
    (folder / "rank2.json").write_text(json.dumps({"103_3": [1, 2, 3, 4]}))
    with pytest.raises(EplbError, match="iteration 103 has no counts for layer 4"):
        read_trtllm_loads([folder])
    (folder / "rank2.json").write_text(json.dumps({"100_3": [1, 2, 3]}))
    with pytest.raises(EplbError, match=r"100_3 has shape \[3\]; expected 4 counts"):
        read_trtllm_loads([folder])
    (folder / "rank2.json").write_text(json.dumps({"100_3": [1, 2, 3, -1]}))
    with pytest.raises(EplbError, match=r"100_3\[3\]: count is -1; counts must be >= 0"):
        read_trtllm_loads([folder])
    (folder / "rank2.json").write_text(json.dumps({"layer3": [1, 2, 3, 4]}))
    with pytest.raises(EplbError, match=r"'layer3' is not '\{iteration\}_\{layer\}'"):
        read_trtllm_loads([folder])
    (folder / "rank2.json").unlink()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts_per_token": 2}))
    with pytest.raises(EplbError, match="missing 'num_experts'"):
        read_trtllm_loads([folder])
    (folder / "meta_info.json").unlink()
    with pytest.raises(EplbError, match=r"no meta_info\.json"):
        read_trtllm_loads([folder])
    (tmp_path / "rank0.safetensors").write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(EplbError, match=r"rank0\.safetensors: not a readable safetensors file"):
        read_safetensors(tmp_path / "rank0.safetensors")


def test_safetensors_dtypes_read_back(tmp_path: Path) -> None:
    """TensorRT-LLM writes int counts; floats read back too, dtypes kept."""
    arrays: dict[str, NDArray[Any]] = {"100_3": np.arange(4, dtype=np.int64), "f": np.ones((2, 3), dtype=np.float32)}
    safetensors.numpy.save_file(arrays, str(tmp_path / "x.safetensors"))
    got = read_safetensors(tmp_path / "x.safetensors")
    assert all(np.array_equal(got[k], v) and got[k].dtype == v.dtype for k, v in arrays.items())


def test_vllm_counts_and_physical_folding(tmp_path: Path) -> None:
    np.save(tmp_path / "logical.npy", np.array([[[1, 2, 3, 4]], [[1, 1, 1, 1]]]))
    loads = read_vllm_loads([tmp_path / "logical.npy"])
    assert loads.counts.shape == (2, 1, 4) and loads.window.tolist() == [[2, 3, 4, 5]]
    # vLLM's expert_load_window counts physical slots: [steps, layers, P], folded with the live map.
    window = np.array([[[1, 2, 3, 4, 5, 6], [1, 1, 1, 1, 1, 1]]])
    np.savez(tmp_path / "phys.npz", expert_load_window=window, physical_to_logical_map=np.array(PHY2LOG))
    folded = read_vllm_loads([tmp_path / "phys.npz"])
    assert folded.window.tolist() == [[6, 8, 3, 4], [1, 1, 2, 2]]
    np.save(tmp_path / "phys.npy", window)
    assert read_vllm_loads([tmp_path / "phys.npy"], phy2log=np.array(PHY2LOG)).window.tolist() == folded.window.tolist()
    # vLLM's -1 (empty slot, no weights) folds nowhere; a count recorded there means the wrong map
    empty_map = np.array([[0, 1, 2, 3, -1, -1], PHY2LOG[1]])
    window_with_empty = np.array([[[1, 2, 3, 4, 0, 0], [1, 1, 1, 1, 1, 1]]])
    assert fold_physical(window_with_empty.astype(float), empty_map)[0].tolist() == [[1, 2, 3, 4], [1, 1, 2, 2]]
    with pytest.raises(EplbError, match=r"slot 4 of layer 0 is empty \(-1\) in the map but counted 5 tokens"):
        fold_physical(window.astype(float), empty_map)
    with pytest.raises(EplbError, match="physical_to_logical_map holds -2"):
        fold_physical(window.astype(float), np.array([[0, 1, 2, 3, -2, 0], PHY2LOG[1]]))
    with pytest.raises(EplbError, match="counts have 2 layers x 6 slots but the physical_to_logical_map is"):
        fold_physical(window.astype(float), np.array([PHY2LOG[0]]))
    (tmp_path / "bad.json").write_text(json.dumps({"steps": []}))
    with pytest.raises(EplbError, match="expected a 'counts' field"):
        import_loads("vllm", [tmp_path / "bad.json"])
    with pytest.raises(EplbError, match="unknown load format"):
        import_loads("deepspeed", [tmp_path / "bad.json"])


def test_a_vllm_expert_load_window_without_its_map_is_refused(tmp_path: Path) -> None:
    """vLLM's expert_load_window counts physical slots; without a physical_to_logical_map the import read its 320
    slots as 320 logical experts ("58 layers x 320 experts"), and eplb solve placed 320 "experts"."""
    window = np.array([[[1, 2, 3, 4, 5, 6], [1, 1, 1, 1, 1, 1]]])
    np.savez(tmp_path / "nomap.npz", expert_load_window=window)
    (tmp_path / "nomap.json").write_text(json.dumps({"expert_load_window": window.tolist()}))
    for name in ("nomap.npz", "nomap.json"):
        with pytest.raises(EplbError, match=r"expert_load_window counts vLLM's physical slots \(\[steps, layers, "
                           r"slots\]\), not logical experts, and no physical_to_logical_map comes with it .*: save the "
                           r"map next to the window, or give the placement that was live \(--placement\)$"):
            read_vllm_loads([tmp_path / name])
        folded = read_vllm_loads([tmp_path / name], phy2log=np.array(PHY2LOG))  # the live placement's map
        assert folded.window.tolist() == [[6, 8, 3, 4], [1, 1, 2, 2]]
    np.savez(tmp_path / "logical.npz", counts=window)  # logical counts need no map
    assert read_vllm_loads([tmp_path / "logical.npz"]).window.shape == (2, 6)


def test_statistics_npz_arrays_are_read_by_name(tmp_path: Path) -> None:
    """import-load took a lone array of any name (--from sglang, an npz holding only `foo`) and, of two arrays it
    reads, the first it looked for (counts over expert_load_window): which counts a file holds is no guess."""
    counts = np.ones((2, 1, 4))
    np.savez(tmp_path / "foo.npz", foo=counts)
    with pytest.raises(EplbError, match=r"foo\.npz: expected an array named 'logical_count' \(or one saved without a "
                       r"name, np\.savez\(file, array\)\), found \['foo'\]$"):
        read_sglang_loads([tmp_path / "foo.npz"])
    np.savez(tmp_path / "two.npz", counts=counts, expert_load_window=counts)
    with pytest.raises(EplbError, match=r"two\.npz: holds both 'counts' and 'expert_load_window', so which counts to "
                       "read is unclear; keep one$"):
        read_vllm_loads([tmp_path / "two.npz"])
    np.savez(tmp_path / "unnamed.npz", counts)  # np.savez's arr_0: the one array, as documented
    assert read_sglang_loads([tmp_path / "unnamed.npz"]).window.tolist() == [[2, 2, 2, 2]]
    assert read_vllm_loads([tmp_path / "unnamed.npz"]).window.tolist() == [[2, 2, 2, 2]]


def test_written_windows_read_back(tmp_path: Path) -> None:
    np.save(tmp_path / "c.npy", np.arange(2 * 3 * 4).reshape(2, 3, 4))
    loads = read_vllm_loads([tmp_path / "c.npy"])
    write_loads(loads, tmp_path / "w.json")
    data = json.loads((tmp_path / "w.json").read_text())
    assert "layer_ids" not in data and data["num_steps"] == 2 and "vllm" in data["format"]  # MoE layer positions
    window = read_window(tmp_path / "w.json")
    assert window.loads.tolist() == loads.window.tolist() and "layer_ids" not in window.meta
    write_loads(loads, tmp_path / "steps.npz", keep_steps=True)
    with np.load(tmp_path / "steps.npz") as npz:
        assert npz["counts"].shape == (2, 3, 4) and "layer_ids" not in npz.files
    assert read_window(tmp_path / "steps.npz").loads.tolist() == loads.window.tolist()
    last = loads.select_steps(-1, None)
    assert last.window.tolist() == np.arange(12, 24).reshape(3, 4).tolist()
    with pytest.raises(EplbError, match="--steps 5: selects none of the 2 recorded steps"):
        loads.select_steps(5, None)
    with pytest.raises(EplbError, match="unknown output type"):
        write_loads(loads, tmp_path / "w.csv")


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_export_and_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_placement(_placement(), tmp_path / "p.json")
    out = tmp_path / "p.sglang.json"
    assert _cli(["export", "--placement", str(tmp_path / "p.json"), "--to", "sglang", "--layer-ids", "3-4",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--ep-num-redundant-experts 2" in printed and "model layers 3-4" in printed
    assert len(json.loads(out.read_text())["physical_to_logical_map"]) == 5
    # SGLang file back to TensorRT-LLM, keeping only the MoE rows.
    yaml_out = tmp_path / "lb.yaml"
    assert _cli(["export", "--placement", str(out), "--gpus", "3", "--layer-ids", "3-4", "--to", "trtllm",
                 "--out", str(yaml_out)]) == 0
    assert parse_trtllm_yaml(yaml_out.read_text())["initial_global_assignments"] == {3: PHY2LOG[0], 4: PHY2LOG[1]}
    folder, expected = _trtllm_dir(tmp_path)
    assert _cli(["import-load", "--from", "trtllm", str(folder), "--steps=-2:", "--out",
                 str(tmp_path / "w.json")]) == 0
    window = read_window(tmp_path / "w.json")
    assert window.loads.tolist() == expected[1:].sum(axis=0).tolist() and window.meta["layer_ids"] == [3, 4]
    with pytest.raises(EplbError, match="--placement applies to --from vllm and trtllm only"):
        _cli(["import-load", "--from", "sglang", str(folder), "--placement", str(tmp_path / "p.json"),
              "--out", str(tmp_path / "x.json")])


def test_cli_export_bounds_layer_ids_by_the_placements_layers(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`eplb export --layer-ids 0-99999999` expanded the whole range before any check (parse_layer_ids without
    max_count): it is refused now at the placement's layer count, before expanding, in one line naming the flag;
    --num-model-layers is a model's layer count, and bounds the ids too."""
    import time

    from eplb.cli import main

    save_placement(_placement(), tmp_path / "p.json")  # 2 layers
    base = ["export", "--placement", str(tmp_path / "p.json"), "--to", "sglang", "--out", str(tmp_path / "o.json")]
    started = time.perf_counter()
    assert main([*base, "--layer-ids", "0-99999999"]) == 2
    assert time.perf_counter() - started < 2
    err = capsys.readouterr().err.strip()
    assert err == ("eplb export: error: --layer-ids: '0-99999999' names more than the placement's 2 layers: give "
                   "one model layer per placement layer"), err
    assert main([*base, "--layer-ids", "3,61", "--num-model-layers", "61"]) == 2
    assert "--layer-ids: layer 61 is beyond the model's 61 layers (0-60)" in capsys.readouterr().err
    assert main([*base, "--layer-ids", "0,999999999"]) == 2  # SGLang would write a billion rows
    assert "--layer-ids: layer 999999999 is beyond any model's layers" in capsys.readouterr().err
    for bad in ("0", "99999999999"):
        with pytest.raises(SystemExit):
            main([*base, "--layer-ids", "3-4", "--num-model-layers", bad])
        assert "--num-model-layers: " in capsys.readouterr().err
    assert main([*base, "--layer-ids", "3-4", "--num-model-layers", "61"]) == 0
    assert len(json.loads((tmp_path / "o.json").read_text())["physical_to_logical_map"]) == 61


def test_gpus_without_a_placement_says_what_is_true_for_each_source(tmp_path: Path) -> None:
    """--from sglang --gpus 8 was told to 'give --placement with it', which --from sglang refuses: SGLang records
    logical experts and needs neither. --from vllm and trtllm are still told to give the placement."""
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps({"logical_count": [[[1, 2, 3], [4, 5, 6]]]}))
    out = str(tmp_path / "w.json")
    with pytest.raises(EplbError) as sglang:
        _cli(["import-load", "--from", "sglang", str(sg), "--gpus", "8", "--out", out])
    assert str(sglang.value) == ("--gpus is the EP size of the --placement that --from vllm and trtllm take: SGLang "
                                 "records logical experts, so --from sglang needs neither: drop --gpus")
    assert "give --placement" not in str(sglang.value)
    assert _cli(["import-load", "--from", "sglang", str(sg), "--out", out]) == 0  # as it says: without --gpus
    folder, _ = _trtllm_dir(tmp_path)
    with pytest.raises(EplbError) as trtllm:
        _cli(["import-load", "--from", "trtllm", str(folder), "--gpus", "8", "--out", out])
    assert str(trtllm.value) == ("--gpus is the EP size of an SGLang or TensorRT-LLM --placement: give --placement "
                                 "with it, or drop --gpus")


def test_cli_export_of_a_whole_model_placement_keys_the_presets_moe_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A placement of all of DeepSeek-V3's 58 MoE layers without layer ids: the service's export wrote SGLang's 61
    model layers (the 3 dense ones first), `eplb export` 58 rows (the MoE layers as model layers 0..57). Both now
    take the preset's first_dense_layers; --layer-ids still names others; a Mixtral placement (no dense layers)
    keeps its rows."""
    rng = np.random.default_rng(0)
    phy2log = np.stack([np.concatenate([rng.permutation(256), rng.integers(0, 256, 32)]) for _ in range(58)])
    save_placement(Placement(phy2log, np.full(32, 9), 256), tmp_path / "v3.json")
    out = tmp_path / "v3.sglang.json"
    assert _cli(["export", "--placement", str(tmp_path / "v3.json"), "--to", "sglang", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["physical_to_logical_map"]
    assert len(rows) == 61 and rows[3:] == phy2log.tolist() and rows[0] == [s % 256 for s in range(288)]
    assert "model layers 3-60, deepseek-v3's MoE layers after its 3 dense ones" in capsys.readouterr().out
    yaml_out = tmp_path / "v3.yaml"
    assert _cli(["export", "--placement", str(tmp_path / "v3.json"), "--to", "trtllm", "--out", str(yaml_out)]) == 0
    assert list(parse_trtllm_yaml(yaml_out.read_text())["initial_global_assignments"]) == list(range(3, 61))
    capsys.readouterr()
    assert _cli(["export", "--placement", str(tmp_path / "v3.json"), "--to", "sglang", "--layer-ids", "0-57",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["physical_to_logical_map"]
    assert len(rows) == 61 and rows[:58] == phy2log.tolist()  # every model layer's row, as SGLang expects
    assert "warning: SGLang will look for deepseek-v3's MoE layers 58-60 and not find them" in capsys.readouterr().err
    save_placement(_placement(), tmp_path / "p.json")  # 2 layers of 4 experts: no preset
    assert _cli(["export", "--placement", str(tmp_path / "p.json"), "--to", "sglang", "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["physical_to_logical_map"]) == 2


def test_trtllm_slot_counts_fold_with_the_live_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With its load balancer on, TensorRT-LLM counts slot ids (meta num_experts = slots): the live load-balancer
    YAML folds them to logical experts; without it, the import says what to pass."""
    folder, expected = _trtllm_dir(tmp_path)  # 4 "experts" per layer: here 4 slots on 2 GPUs
    config = tmp_path / "lb.yaml"
    config.write_text("num_slots: 4\ninitial_global_assignments:\n  3: [0, 1, 2, 0]\n  4: [2, 1, 0, 2]\n")
    out = tmp_path / "w.json"
    assert _cli(["import-load", "--from", "trtllm", str(folder), "--placement", str(config), "--gpus", "2",
                 "--out", str(out)]) == 0
    slots = expected.sum(axis=0)
    folded = [[slots[0, 0] + slots[0, 3], slots[0, 1], slots[0, 2]],
              [slots[1, 2], slots[1, 1], slots[1, 0] + slots[1, 3]]]
    assert read_window(out).loads.tolist() == folded
    assert "no known model has" not in capsys.readouterr().err
    assert _cli(["import-load", "--from", "trtllm", str(folder), "--out", str(out)]) == 0
    assert "4 experts, which no known model has: if TensorRT-LLM's load balancer was on" in capsys.readouterr().err
    config.write_text("num_slots: 4\ninitial_global_assignments:\n  5: [0, 1, 2, 0]\n")
    with pytest.raises(EplbError, match="no row for model layer 3"):
        _cli(["import-load", "--from", "trtllm", str(folder), "--placement", str(config), "--gpus", "2",
              "--out", str(out)])


def test_sglang_circular_buffer_and_pt_hint(tmp_path: Path) -> None:
    """SGLang dumps its whole circular buffer: unwritten rows (all zero) are no steps, and the written ones are
    in time order from the first after them; written rows in several runs are not known to be in order, so
    --steps is refused. The .pt hint runs as printed on a CPU host, with weights_only."""
    torch = pytest.importorskip("torch")  # in the test extra: never skipped in CI
    buffer = torch.zeros((5, 2, 3), dtype=torch.int32)
    buffer[0] = torch.tensor([[1, 2, 3], [0, 1, 0]])
    buffer[1] = torch.tensor([[2, 0, 0], [4, 4, 4]])
    dump = tmp_path / "expert_distribution_recorder_1.pt"
    torch.save({"rank": 0, "logical_count": buffer, "average_utilization_rate_over_window": None}, dump)
    with pytest.raises(EplbError) as info:
        read_sglang_loads([dump])
    command = str(info.value).split("convert once with ", 1)[1]
    assert "map_location='cpu'" in command and "weights_only=True" in command
    subprocess.run(shlex.split(command), cwd=tmp_path, check=True)
    loads = read_sglang_loads([tmp_path / "expert_distribution_recorder_1.npz"])
    assert loads.num_steps == 2 and loads.in_time_order and loads.window.tolist() == [[3, 2, 3], [4, 5, 4]]
    assert loads.select_steps(-1, None).window.tolist() == [[2, 0, 0], [4, 4, 4]]
    wrapped = np.zeros((5, 1, 2))  # a second recording wrote rows 3, 4, then 0: the buffer keeps its position
    wrapped[[3, 4, 0], 0, 0] = [1, 2, 3]
    np.savez(tmp_path / "wrapped.npz", logical_count=wrapped)
    loads = read_sglang_loads([tmp_path / "wrapped.npz"])
    assert loads.in_time_order and loads.counts[:, 0, 0].tolist() == [1, 2, 3] and not loads.order_note
    wrapped[3], wrapped[2, 0, 1] = 0, 5  # rows 2, 4, 0 written: two runs, so where it wrapped is unknown
    np.savez(tmp_path / "split.npz", logical_count=wrapped)
    split = read_sglang_loads([tmp_path / "split.npz"])
    assert not split.in_time_order and split.window.tolist() == [[5, 5]]
    with pytest.raises(EplbError, match=r"not in time order \(split.npz: rows without counts split its recorded "
                       r"steps into 2 runs, so where a circular buffer wrapped is unknown\)"):
        split.select_steps(-1, None)


def test_an_unbounded_sglang_recording_is_in_time_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--expert-distribution-recorder-buffer-size -1` (docs/integrations.md's recipe) dumps every recorded step,
    all written: --steps was refused as 'a full circular buffer ... record into an unbounded buffer'. Its rows
    cannot tell it from a full circular buffer, so --steps says what it assumes."""
    counts = np.arange(1, 5 * 2 * 3 + 1).reshape(5, 2, 3)
    sg, out = tmp_path / "sg.json", tmp_path / "w.json"
    sg.write_text(json.dumps({"logical_count": counts.tolist()}))
    assert _cli(["import-load", "--from", "sglang", str(sg), "--steps=-2:", "--out", str(out)]) == 0
    assert read_window(out).loads.tolist() == counts[-2:].sum(axis=0).tolist()
    assert capsys.readouterr().err == (
        f"note: {sg.name}: every row holds counts (5 rows): read in time order, as SGLang's unbounded buffer "
        "(--expert-distribution-recorder-buffer-size -1) dumps them; a full circular buffer of 5 rows (buffer size "
        "5; SGLang's default is 1000) is rotated by an offset the dump does not record, and --steps would pick "
        "arbitrary steps of it\n")
    assert _cli(["import-load", "--from", "sglang", str(sg), "--out", str(out)]) == 0
    assert capsys.readouterr().err == ""  # the sum does not depend on the order
    np.savez(tmp_path / "window.npz", expert_load_window=counts,  # vLLM's window is always circular
             physical_to_logical_map=np.array([[0, 1, 2], [0, 1, 2]]))
    with pytest.raises(EplbError, match=r"not in time order \(a full expert_load_window: vLLM fills it"):
        _cli(["import-load", "--from", "vllm", str(tmp_path / "window.npz"), "--steps=-2:", "--out", str(out)])


def test_a_vllm_window_has_moe_layer_positions_not_model_layers(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM numbers its MoE layers by position (moe_layer_idx 0..57 for DeepSeek-V3, whose MoE layers are model
    layers 3-60): import-load wrote layer_ids 0..57 as model layers, so evaluate matched the window against the
    SGLang export of the very placement solved on it 3 layers off (lb mean 1.661, no warning), and refused eplb's
    own file ("no row for layer 0"). The window carries no layer_ids now: matched by position, as vLLM means it."""
    from eplb.cli import main

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "sglang6017-dsv3-decode-in1000out1000.json"
    np.savez(tmp_path / "vllm.npz", counts=np.array(json.loads(fixture.read_text())["loads"])[None])
    window, placement = tmp_path / "vdec.json", tmp_path / "p.json"
    assert main(["import-load", "--from", "vllm", str(tmp_path / "vllm.npz"), "--out", str(window)]) == 0
    assert "58 layers (MoE layers 0-57 by position, no model layer ids) x 256 experts" in capsys.readouterr().out
    assert "layer_ids" not in json.loads(window.read_text())
    assert main(["solve", "--loads", str(fixture), "--gpus", "32", "--out", str(placement)]) == 0
    sglang = tmp_path / "p.sglang.json"
    assert main(["export", "--placement", str(placement), "--to", "sglang", "--out", str(sglang)]) == 0
    capsys.readouterr()
    lbs = []
    for loads in (fixture, window):
        assert main(["evaluate", "--loads", str(loads), "--placement", str(placement), "--json"]) == 0
        lbs.append(json.loads(capsys.readouterr().out)["predicted"]["lb"])
    assert lbs[0] == lbs[1] and max(lbs[1]) < 1.01
    assert main(["evaluate", "--loads", str(window), "--placement", str(sglang), "--gpus", "32"]) == 2
    assert "placement is 61 layers x 288 slots of 256 experts but the loads are 58 layers x 256 experts; give the " \
           "placement solved for these loads (eplb's file), or give the loads the model layer of each row " \
           "(layer_ids, e.g. 3-60 for DeepSeek-V3)" in capsys.readouterr().err


def test_vllm_files_are_ranks_summed(tmp_path: Path) -> None:
    """vLLM all-reduces expert_load_window over the EP ranks: one file per rank is summed, not stacked; the
    window's unwritten rows are dropped."""
    rank0 = np.array([[[1, 2, 0, 0, 1, 0]], [[0, 0, 0, 0, 0, 0]], [[2, 0, 0, 1, 0, 0]]])  # [steps, layers, P]
    rank1 = np.array([[[0, 0, 3, 0, 0, 2]], [[0, 0, 0, 0, 0, 0]], [[0, 1, 1, 0, 0, 1]]])
    for rank, window in enumerate((rank0, rank1)):
        np.savez(tmp_path / f"rank{rank}.npz", expert_load_window=window,
                 physical_to_logical_map=np.array([PHY2LOG[0]]))
    loads = read_vllm_loads([tmp_path / "rank0.npz", tmp_path / "rank1.npz"])
    assert loads.num_steps == 2 and loads.meta["ranks"] == 2 and loads.in_time_order  # it never wrapped
    assert loads.window.tolist() == [[4, 6, 4, 1]]
    np.savez(tmp_path / "short.npz", expert_load_window=rank0[:2], physical_to_logical_map=np.array([PHY2LOG[0]]))
    with pytest.raises(EplbError, match="files are the EP ranks of one recording"):
        read_vllm_loads([tmp_path / "rank0.npz", tmp_path / "short.npz"])


def test_counts_in_the_import_summaries_are_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One step and one rank file read '1 step' and '1 rank file', not 'step(s)' and 'rank file(s)'; an SGLang dump
    of one written row says so without a hand-made singular."""
    folder, _ = _trtllm_dir(tmp_path)
    (folder / "rank1.safetensors").unlink()
    out = tmp_path / "w.json"
    assert _cli(["import-load", "--from", "trtllm", str(folder), "--steps=-1:", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"TensorRT-LLM expert statistics ({folder}, 1 rank file, iterations 100-102)" in printed, printed
    assert printed.rstrip().endswith("token-expert assignments per layer summed over 1 step"), printed
    steps = tmp_path / "s.json"
    assert _cli(["import-load", "--from", "trtllm", str(folder), "--keep-steps", "--out", str(steps)]) == 0
    assert "wrote " in (printed := capsys.readouterr().out) and ": 3 steps x 2 layers" in printed, printed
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps({"logical_count": [[[1, 2, 3], [4, 5, 6]]]}))
    assert _cli(["import-load", "--from", "sglang", str(sg), "--steps=0:1", "--out", str(out)]) == 0
    assert "every row holds counts (1 row)" in capsys.readouterr().err
