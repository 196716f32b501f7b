"""docs/architecture.md's promise: a new solver is one module plus one registration line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eplb.solve import Cluster, solve
from solvers import registry
from solvers.registry import Options, Problem, SolverError
from solvers.validation import InvalidPlacement

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_documented_toy_solver_works_through_cli_and_solve(tmp_path: Path) -> None:
    module, registration = _doc_blocks()
    (tmp_path / "round_robin.py").write_text(module)
    line = registration.strip().splitlines()[-1].replace("solvers.round_robin", "round_robin")
    script = f"""
import json, sys
sys.path.insert(0, {str(tmp_path)!r})
from solvers.registry import register
{line}
from eplb.cli import main
sys.exit(main(["solve", "--solver", "round-robin", "--gpus", "8", "--redundant", "8", "--json"]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["solver"]["name"] == "round-robin"
    first = answer["placement"]["phy2log"][0]
    assert first == [i % 256 for i in range(264)]


def test_every_registered_solver_is_loadable_and_named_like_its_entry() -> None:
    for name in registry.names():
        cls = registry.get_solver(name)
        assert cls.name == name and cls.summary


def test_check_refuses_in_one_place() -> None:
    loads = np.ones((1, 8))
    problem = Problem(loads, np.array([3, 3, 3]))
    with pytest.raises(SolverError, match="does not take time_limit_s"):
        registry.check("greedy", problem, Options(time_limit_s=1.0))
    with pytest.raises(SolverError, match="unknown solver 'nope'"):
        registry.check("nope", problem, Options())
    with pytest.raises(SolverError, match="same slot count"):
        registry.check("deepseek", Problem(loads, np.array([4, 5])), Options())
    with pytest.raises(SolverError, match="cannot hold 8 experts"):
        registry.check("greedy", Problem(loads, np.array([2, 2])), Options())


def test_solve_validates_what_a_solver_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    greedy = registry.get_solver("greedy")

    def broken(self: object, problem: Problem, options: Options) -> registry.Solution:
        return registry.Solution(np.zeros((1, 9), dtype=np.int64))  # expert 0 everywhere

    monkeypatch.setattr(greedy, "solve", broken)
    with pytest.raises(InvalidPlacement, match="no replica"):
        solve(np.ones((1, 8)), Cluster(np.array([3, 3, 3])))


def test_move_budgets_and_targets_are_checked_once() -> None:
    loads = np.ones((1, 8))
    current = np.tile(np.arange(9) % 8, (1, 1))
    with pytest.raises(SolverError, match="max_moves: a move budget needs the serving placement"):
        registry.check("greedy", Problem(loads, np.array([3, 3, 3])), Options(max_moves=5))
    with pytest.raises(SolverError, match="target_lb must be >= 1"):
        registry.check("incremental", Problem(loads, np.array([3, 3, 3]), current_phy2log=current),
                       Options(target_lb=0.5))
