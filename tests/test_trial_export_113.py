"""A hostile user's trial of `eplb export` and foreign placements (`--current`): files eplb wrote or read that the
engine would reject, or read otherwise than eplb did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eplb.cli import main
from eplb.errors import EplbError
from eplb.io.exports import write_export
from eplb.io.foreign import read_placement_file
from eplb.placement import Placement

_VLLM_ASCEND = {"moe_layer_count": 1, "layer_list": [{"layer_id": 0, "device_count": 2, "device_list": [
    {"device_id": 0, "device_expert": [1, 3, 2]}, {"device_id": 1, "device_expert": [3, 2, 0]}]}]}


def _placement() -> Placement:
    """1 layer x 6 slots of 4 experts on 2 GPUs."""
    return Placement(np.array([[1, 3, 2, 3, 2, 0]]), np.array([3, 3]), 4)


@pytest.mark.parametrize("name", ["P.JSON", "p.Json", "placement.sglang.JSON"])
def test_an_sglang_file_is_named_as_sglang_tests_it(tmp_path: Path, name: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang reads --init-expert-location as a file when the text ends in '.json', case and all
    (`data.endswith(".json")`); `export --to sglang --out P.JSON` was written, and SGLang parsed 'P.JSON' as JSON."""
    with pytest.raises(EplbError, match=r"ends in \.json"):
        write_export(_placement(), "sglang", tmp_path / name)
    (tmp_path / "p.json").write_text(json.dumps(_placement().to_dict()))
    assert main(["export", "--placement", str(tmp_path / "p.json"), "--to", "sglang", "--out",
                 str(tmp_path / name)]) == 2
    assert "ends in .json" in capsys.readouterr().err
    assert not (tmp_path / name).exists()


def _ascend(tmp_path: Path, edit: Any) -> Path:
    data = json.loads(json.dumps(_VLLM_ASCEND))
    edit(data)
    path = tmp_path / "map.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["layer_list"][0]["device_list"][0].update(device_expert=[1, 1, 2]),
         r"layer_list\[0\]\.device_list\[0\]\.device_expert holds expert 1 twice"),
        (lambda d: d["layer_list"][0]["device_list"][0].update(device_expert=[1, 3]),
         r"layer_list\[0\] has \[2, 3\] slots per device"),
        (lambda d: d.pop("moe_layer_count"), r"no moe_layer_count"),
        (lambda d: d["layer_list"][0].pop("device_count"), r"layer_list\[0\] has no device_count"),
    ],
)
def test_a_vllm_ascend_map_vllm_ascend_would_not_serve_is_refused(tmp_path: Path, edit: Any, message: str) -> None:
    """vllm-ascend maps each expert to one local slot per device (a second copy is overwritten), builds one
    [layers, devices, slots] tensor, and reads `moe_layer_count` and layer 0's `device_count` as required keys (a
    KeyError falls back to its default map); each such map was read as the placement served."""
    path = _ascend(tmp_path, edit)
    with pytest.raises(EplbError, match=f"^{path}: {message}"):
        read_placement_file(path)


def test_a_json_null_is_not_called_yaml(tmp_path: Path) -> None:
    """A .json placement holding `null` said 'expected a YAML mapping with num_slots and ...'."""
    path = tmp_path / "p.json"
    path.write_text("null")
    with pytest.raises(EplbError, match=r"^\S+p\.json: expected an object \(ours: phy2log"):
        read_placement_file(path)


@pytest.mark.parametrize("extra", [{"note": "x"}, {"logical_count": [[1, 1, 1, 1]]}])
def test_an_sglang_map_with_another_key_is_refused(tmp_path: Path, extra: dict[str, Any]) -> None:
    """SGLang passes every key of its file to init_by_mapping (a TypeError at start-up): a map with another key was
    read as the placement served."""
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[1, 3, 2, 3, 2, 0]], **extra}))
    with pytest.raises(EplbError, match=f"^{path}: SGLang passes every key .* key '{next(iter(extra))}': drop it$"):
        read_placement_file(path, num_gpus=2)


def test_an_sglang_map_of_fractional_looking_ids_is_refused(tmp_path: Path) -> None:
    """SGLang makes a tensor of its map (`torch.tensor`): one 2.0 among the ids makes it a float tensor, which it
    cannot index its expert lists by (a TypeError at start-up); eplb read 2.0 as expert 2."""
    path = tmp_path / "s.json"
    path.write_text('{"physical_to_logical_map": [[1, 3, 2, 3, 2.0, 0]]}')
    with pytest.raises(EplbError, match=rf"^{path}: physical_to_logical_map\[0\]\[4\] is 2\.0: SGLang"):
        read_placement_file(path, num_gpus=2)
    path.write_text('{"physical_to_logical_map": [[1, 3, 2, 3, 2, 0]]}')
    assert read_placement_file(path, num_gpus=2).placement.phy2log.tolist() == [[1, 3, 2, 3, 2, 0]]


def test_a_trtllm_num_slots_of_text_is_shown_as_text(tmp_path: Path) -> None:
    """num_slots "6" said 'num_slots is 6 but the assignments list 6 slots per layer'."""
    path = tmp_path / "t.yaml"
    path.write_text('num_slots: "6"\ninitial_global_assignments:\n  0: [1, 3, 2, 3, 2, 0]\n')
    with pytest.raises(EplbError, match=f"^{path}: num_slots is '6' but the assignments list 6 slots per layer"):
        read_placement_file(path, num_gpus=2)


def test_a_trtllm_layer_key_beyond_any_model_is_refused(tmp_path: Path) -> None:
    """A key of 1000000000000 was read as that model layer and written back (--to trtllm, --to json), though
    --layer-ids refuses a layer at or beyond MAX_MODEL_LAYERS."""
    path = tmp_path / "t.yaml"
    path.write_text("num_slots: 6\ninitial_global_assignments:\n  0: [1, 3, 2, 3, 2, 0]\n"
                    "  1000000000000: [1, 3, 2, 3, 2, 0]\n")
    with pytest.raises(EplbError, match=rf"^{path}: initial_global_assignments key 1000000000000 is beyond any "
                       r"model's layers \(at most 10,000\)"):
        read_placement_file(path, num_gpus=2)
