"""The engine plug-ins against the engines' default algorithm on the shipped real DeepSeek-V3 windows.

Run: python benchmarks/engines.py [--ep 32] [--slots 288] [--nodes 4] [--groups 8] [--budget 1000]

The three DeepSeek-V3 windows SGLang published (prefill in1024, prefill in4096, decode in1000/out1000;
58 MoE layers x 256 experts) are served one after another in every order (6 transitions). Each policy
places the first window, then rebalances to the second with its own first placement as the serving map,
as an engine does. Printed per policy: lb on the second window (mean over layers) and expert copies of
the rebalance, as median [min, max] over the 6 transitions.

Policies:
- engine default: DeepSeek EPLB (vLLM's `default` policy and SGLang's `deepseek`/`auto`); vLLM's
  `preserve_intragpu_slots` only reorders slots inside a GPU, so its copies are DeepSeek's;
- eplb plug-in (default settings): eplb's incremental rebalancer from the old map, kept when its lb is within
  1% of a fresh DeepSeek placement's (else that placement, GPUs relabelled to keep experts in place);
- eplb plug-in, EPLB_SOLVER=greedy: a fresh eplb greedy placement, GPUs relabelled to keep experts in place;
- eplb plug-in, EPLB_MAX_MOVES=N: at most N copies per rebalance.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import numpy as np
import torch

from eplb.integrations import core
from eplb.integrations.vllm import EplbPolicy
from solvers.greedy import rebalance_experts

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = {
    "prefill-in1024": ROOT / "eplb" / "data" / "dsv3-prefill-in1024.json",
    "prefill-in4096": ROOT / "fixtures" / "sglang6017-dsv3-prefill-in4096.json",
    "decode": ROOT / "fixtures" / "sglang6017-dsv3-decode-in1000out1000.json",
}


def engine_default(
    weight: np.ndarray, slots: int, groups: int, nodes: int, ep: int, old: np.ndarray | None
) -> np.ndarray:
    """DeepSeek's placement; vLLM's slot preservation moves no expert between GPUs, so copies are unchanged."""
    phy2log: np.ndarray = rebalance_experts(weight, slots, groups, nodes, ep)[0]
    return phy2log


def plugin(env: dict[str, str]):  # type: ignore[no-untyped-def]
    def run(weight: np.ndarray, slots: int, groups: int, nodes: int, ep: int, old: np.ndarray | None) -> np.ndarray:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            old_t = None if old is None else torch.from_numpy(old)
            placed: np.ndarray = EplbPolicy.rebalance_experts(torch.from_numpy(weight), slots, groups, nodes, ep,
                                                              old_t).numpy()
            return placed
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ep", type=int, default=32, help="EP ranks (GPUs)")
    parser.add_argument("--slots", type=int, default=288, help="physical expert slots in all")
    parser.add_argument("--nodes", type=int, default=4, help="nodes (hierarchical policy when groups divide)")
    parser.add_argument("--groups", type=int, default=8, help="expert groups (DeepSeek-V3: 8)")
    parser.add_argument("--budget", type=int, default=1000, help="EPLB_MAX_MOVES for the budgeted row")
    args = parser.parse_args()
    windows = {name: np.asarray(json.loads(p.read_text())["loads"], dtype=np.float64) for name, p in WINDOWS.items()}
    policies = {
        "engine default (DeepSeek EPLB)": engine_default,
        "eplb plug-in, defaults": plugin({}),
        "eplb plug-in, EPLB_SOLVER=greedy": plugin({"EPLB_SOLVER": "greedy"}),
        f"eplb plug-in, EPLB_MAX_MOVES={args.budget}": plugin({"EPLB_MAX_MOVES": str(args.budget)}),
    }
    shape = (args.slots, args.groups, args.nodes, args.ep)
    print(
        f"DeepSeek-V3, EP{args.ep}, {args.slots} slots, {args.groups} groups, {args.nodes} nodes; "
        f"{len(windows)} real windows, {len(windows) * (len(windows) - 1)} transitions"
    )
    print(f"{'policy':<40} {'lb after (median [min, max])':>30} {'copies (median [min, max])':>30}")
    for name, policy in policies.items():
        lbs, copies = [], []
        for first, second in itertools.permutations(windows, 2):
            old = policy(windows[first], *shape, None)
            new = policy(windows[second], *shape, old)
            lbs.append(float(core.layer_lb(windows[second], new, args.ep).mean()))
            copies.append(int(core.moves(new, old, args.ep).sum()))
        lb_text = f"{np.median(lbs):.4f} [{min(lbs):.4f}, {max(lbs):.4f}]"
        copy_text = f"{int(np.median(copies))} [{min(copies)}, {max(copies)}]"
        print(f"{name:<40} {lb_text:>30} {copy_text:>30}")


if __name__ == "__main__":
    main()
