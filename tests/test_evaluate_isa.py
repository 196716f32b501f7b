"""Every loop body of the compiled replay evaluation (eplb/replay/_evaluate.c: AVX-512, AVX2, 4 lanes) gives the
same numbers: each runs in its own process with EPLB_EVALUATE_ISA, on uneven slots, zero counts and tail tiles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = """
import sys, numpy as np
from eplb.placement import Placement
from eplb.replay import _evaluate
from eplb.replay.evaluate import Evaluator
from eplb.replay.run import time_model
from eplb.solve import CostSetup
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS, link_bandwidth
from solvers.greedy import solve_greedy

rng = np.random.default_rng(7)
counts = rng.poisson(rng.gamma(0.6, 40.0, size=(1, 3, 64)), size=(77, 3, 64)).astype(np.int32)
counts[5:9, :, :20] = 0  # zero counts
slots = np.array([9, 8, 10, 9, 8, 9, 9, 10])
window = counts[:40].sum(axis=0).astype(float)
placements = [Placement(solve_greedy(window, slots), slots, 64),
              Placement(np.tile(np.arange(72) % 64, (3, 1)), np.full(8, 9), 64)]
hw = HARDWARE_PRESETS["h100"]
tm = time_model(CostSetup(MODEL_PRESETS["deepseek-v2-lite"], hw, link_bandwidth(hw, "nvlink"), 256.0), 8)
ev = Evaluator(tm)
ev.set_placements(placements)
lb, t = ev.evaluate(counts)
np.savez(sys.argv[1], lb=lb, t=t, isa=np.array(_evaluate.instruction_set))
"""


def _run(isa: str | None, out: Path) -> dict[str, np.ndarray]:
    env = {k: v for k, v in os.environ.items() if k != "EPLB_EVALUATE_ISA"}
    if isa is not None:
        env["EPLB_EVALUATE_ISA"] = isa
    subprocess.run([sys.executable, "-c", SCRIPT, str(out)], env=env, check=True, capture_output=True, text=True)
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


def test_every_loop_body_gives_the_same_numbers(tmp_path: Path) -> None:
    best = _run(None, tmp_path / "best.npz")
    for isa in ("avx2", "base"):
        narrow = _run(isa, tmp_path / f"{isa}.npz")
        widths = ["scalar", "base", "avx2", "avx512"]
        assert widths.index(str(narrow["isa"])) <= widths.index(isa)  # the variable narrows the loop bodies
        assert widths.index(str(narrow["isa"])) <= widths.index(str(best["isa"]))
        assert np.array_equal(narrow["lb"], best["lb"]), isa
        assert np.array_equal(narrow["t"], best["t"]), isa
