"""Engine files the readers once read into a wrong answer (exit 0), now refused naming the file and what is
wrong: TensorRT-LLM placement keys that are not layer numbers or name a layer twice, a vLLM map that leaves
experts without a slot, a TensorRT-LLM rank file missing a key, and another engine's JSON given as vLLM's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from eplb.errors import EplbError
from eplb.io.foreign import read_placement_any
from eplb.io.statistics import import_loads, read_trtllm_loads, read_vllm_loads

ROWS = ("[0, 1, 2, 0, 1, 3]", "[0, 3, 2, 1, 3, 2]")


def _yaml(tmp_path: Path, key_a: str, key_b: str, name: str = "t.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"num_slots: 6\ninitial_global_assignments:\n  {key_a}: {ROWS[0]}\n  {key_b}: {ROWS[1]}\n")
    return path


@pytest.mark.parametrize("key", ["3.9", "0.5", "true", "false", "-1", "'x'", "null"])
def test_a_trtllm_key_that_is_no_layer_number_is_refused(tmp_path: Path, key: str) -> None:
    """3.9 was read as layer 3, true as layer 1, 0.5 as layer 0."""
    path = _yaml(tmp_path, "5", key)
    shown = {"'x'": "'x'", "null": "None", "true": "True", "false": "False"}.get(key, key)
    with pytest.raises(EplbError, match=f"^{re.escape(str(path))}: initial_global_assignments key "
                       rf"{re.escape(shown)} is not a layer number \(a whole number >= 0"):
        read_placement_any(path, num_gpus=2)


def test_trtllm_layer_numbers_are_read_as_ids_are(tmp_path: Path) -> None:
    """Whole numbers, as `int_list` reads ids (3.0 is layer 3), and JSON's text keys."""
    assert read_placement_any(_yaml(tmp_path, "3", "5.0"), num_gpus=2).layer_ids == (3, 5)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"num_slots": 6, "initial_global_assignments": {"4": [0, 1, 2, 0, 1, 3],
                                                                               "3": [0, 3, 2, 1, 3, 2]}}))
    assert read_placement_any(path, num_gpus=2).phy2log[0].tolist() == [0, 3, 2, 1, 3, 2]


def test_a_trtllm_layer_given_twice_is_refused(tmp_path: Path) -> None:
    """YAML's safe_load (and json.loads) kept only the last row of a repeated key, silently."""
    path = _yaml(tmp_path, "3", "3")
    with pytest.raises(EplbError, match=f"^{re.escape(str(path))}: line 4: key 3 appears twice in one mapping "
                       r"\(YAML would keep only the last\); give each key once$"):
        read_placement_any(path, num_gpus=2)
    path = _yaml(tmp_path, "3", "3.0", "float.yaml")
    with pytest.raises(EplbError, match=r"float.yaml: line 4: key 3.0 repeats key 3 in one mapping"):
        read_placement_any(path, num_gpus=2)
    path = tmp_path / "t.json"
    path.write_text('{"num_slots": 6, "initial_global_assignments": {"3": [0, 1, 2, 0, 1, 3], '
                    '"3": [0, 3, 2, 1, 3, 2]}}')
    with pytest.raises(EplbError, match=f"^{re.escape(str(path))}: key '3' appears twice in one object"):
        read_placement_any(path, num_gpus=2)
    path.write_text(json.dumps({"num_slots": 6, "initial_global_assignments": {"3": [0, 1, 2, 0, 1, 3],
                                                                               "03": [0, 3, 2, 1, 3, 2]}}))
    with pytest.raises(EplbError, match=r"t.json: initial_global_assignments keys '3' and '03' are both layer 3; "
                       "give each layer once$"):
        read_placement_any(path, num_gpus=2)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("num_slots: 6\nrow: &r [0, 1, 2, 0, 1, 3]\nbase: &b {3: *r}\n"
                    "initial_global_assignments:\n  <<: *b\n  3: [0, 3, 2, 1, 3, 2]\n")
    assert read_placement_any(path, num_gpus=2).phy2log.tolist() == [[0, 3, 2, 1, 3, 2]]


def test_a_vllm_map_leaving_experts_without_a_slot_is_refused(tmp_path: Path) -> None:
    """An id of 9 among 0..3 made the window '3 layers x 10 experts', experts 3-8 with no slot."""
    path = tmp_path / "b.npz"
    np.savez(path, expert_load_window=np.ones((2, 3, 6), int),
             physical_to_logical_map=np.array([[0, 1, 2, 0, 1, 9]] * 3))
    with pytest.raises(EplbError, match=f"^{re.escape(str(path))}: physical_to_logical_map gives logical expert 3 "
                       r"no slot in layer 0 though its ids run to 9 \(18 missing in all\); every expert has a slot"):
        read_vllm_loads([path])
    np.savez(path, expert_load_window=np.ones((2, 3, 6), int),
             physical_to_logical_map=np.array([[0, 1, 2, 0, 1, 3]] * 2 + [[0, 1, 2, 0, 1, 2]]))
    with pytest.raises(EplbError, match="gives logical expert 3 no slot in layer 2 though its ids run to 3"):
        read_vllm_loads([path])
    table = np.array([[0, 1, 2, 0, 1, 3], [0, 1, 2, 3, -1, -1], [3, 2, 1, 0, 0, 0]])  # -1: an absent rank's slots
    np.savez(path, expert_load_window=np.ones((2, 3, 6), int) * (table >= 0), physical_to_logical_map=table)
    assert read_vllm_loads([path]).window.tolist() == [[4, 4, 2, 2], [2, 2, 2, 2], [6, 2, 2, 2]]


def test_a_trtllm_rank_file_missing_a_key_is_refused(tmp_path: Path) -> None:
    """A rank missing '101_4' was counted as 0 tokens there: layer 4 came out short, exit 0."""
    (tmp_path / "meta_info.json").write_text(json.dumps({"num_experts": 4, "num_experts_per_token": 2}))
    keys = [f"{it}_{layer}" for it in (100, 101) for layer in (3, 4)]
    for rank in range(2):
        records = {key: np.full(4, rank + 1, dtype=np.int64) for key in keys}
        safetensors.numpy.save_file(records, str(tmp_path / f"rank{rank}.safetensors"))
    assert read_trtllm_loads([tmp_path]).window.tolist() == [[6, 6, 6, 6], [6, 6, 6, 6]]
    short = {key: np.full(4, 2, dtype=np.int64) for key in keys if key != "101_4"}
    safetensors.numpy.save_file(short, str(tmp_path / "rank1.safetensors"))
    with pytest.raises(EplbError, match=f"^{re.escape(str(tmp_path / 'rank1.safetensors'))}: no counts for "
                       r"'101_4', which other rank files record; every rank records every iteration and layer"):
        read_trtllm_loads([tmp_path])
    safetensors.numpy.save_file({"100_3": np.ones(4, dtype=np.int64)}, str(tmp_path / "rank1.safetensors"))
    with pytest.raises(EplbError, match=r"rank1.safetensors: no counts for '100_4', '101_3', '101_4', which"):
        read_trtllm_loads([tmp_path])
    safetensors.numpy.save_file({}, str(tmp_path / "rank1.safetensors"))
    for rank in (2, 3):
        safetensors.numpy.save_file({"100_3": np.ones(4, dtype=np.int64)}, str(tmp_path / f"rank{rank}.safetensors"))
    with pytest.raises(EplbError, match=r"rank1.safetensors: no counts for '100_3', '100_4', '101_3' and 1 more,"):
        read_trtllm_loads([tmp_path])


def test_another_engines_json_given_as_vllm_is_refused(tmp_path: Path) -> None:
    """SGLang's dump was read as vLLM counts: its all-zero dense layer kept, its layer ids dropped."""
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"logical_count": [[[0, 0, 0], [1, 2, 3]]]}))
    with pytest.raises(EplbError, match=f"^{re.escape(str(path))}: this is SGLang's stat dump \\(logical_count\\), "
                       "whose rows are model layers: import it with --from sglang$"):
        import_loads("vllm", [path])
    assert import_loads("sglang", [path]).layer_ids == [1]
    path.write_text(json.dumps({"loads": [[1, 2, 3]], "layer_ids": [3]}))
    with pytest.raises(EplbError, match=r"s.json: this is a load window already \(loads\): give it as --loads"):
        import_loads("vllm", [path])
    path.write_text(json.dumps({"counts": [[[1, 2, 3]]]}))
    assert import_loads("vllm", [path]).window.tolist() == [[1, 2, 3]]


def test_a_key_given_twice_in_any_json_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Load statistics, load windows and spec files kept the last of a repeated key (json.loads), silently, where
    placements refused it: every JSON reader parses through `eplb.io.files.parse_json`, which refuses it."""
    from eplb.cli import main

    twice = "appears twice in one object (JSON readers keep only the last); give each key once"
    sglang = tmp_path / "sg.json"
    sglang.write_text('{"logical_count": [[[1, 2, 3, 4]]], "logical_count": [[[9, 9, 9, 9]]]}')
    vllm = tmp_path / "vllm.json"
    vllm.write_text('{"counts": [[[1, 2, 3, 4]]], "counts": [[[9, 9, 9, 9]]]}')
    trtllm = tmp_path / "stats"
    trtllm.mkdir()
    (trtllm / "meta_info.json").write_text('{"num_experts": 4, "num_experts_per_token": 2}')
    (trtllm / "rank0.json").write_text('{"0_3": [1, 2, 3, 4], "0_3": [9, 9, 9, 9]}')
    out = str(tmp_path / "w.json")
    for argv, file, key in ((["import-load", "--from", "sglang", str(sglang)], sglang, "logical_count"),
                            (["import-load", "--from", "vllm", str(vllm)], vllm, "counts"),
                            (["import-load", "--from", "trtllm", str(trtllm)], trtllm / "rank0.json", "0_3")):
        assert main([*argv, "--out", out]) == 2, argv
        assert capsys.readouterr().err == f"eplb import-load: error: {file}: key {key!r} {twice}\n"
    (trtllm / "rank0.json").write_text('{"0_3": [1, 2, 3, 4]}')
    (trtllm / "meta_info.json").write_text('{"num_experts": 4, "num_experts": 8}')
    assert main(["import-load", "--from", "trtllm", str(trtllm), "--out", out]) == 2
    assert f"{trtllm / 'meta_info.json'}: key 'num_experts' {twice}" in capsys.readouterr().err
    window = tmp_path / "window.json"
    window.write_text('{"loads": [[1, 2, 3, 4]], "loads": [[4, 4, 4, 4]]}')
    assert main(["solve", "--loads", str(window), "--gpus", "2"]) == 2
    assert f"{window}: key 'loads' {twice}" in capsys.readouterr().err
    spec = tmp_path / "hw.json"
    spec.write_text('{"name": "x", "name": "y"}')
    assert main(["cost", "--hardware", str(spec), "--ep", "8", "--tokens-per-gpu", "256"]) == 2
    assert f"key 'name' {twice}" in capsys.readouterr().err
    assert not Path(out).exists()
