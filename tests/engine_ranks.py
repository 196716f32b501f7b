"""EP ranks as real processes for the plug-in tests: `run_ranks` starts one Python process per rank, joined in one
torch.distributed gloo group (the engines' `cpu_group`), each installing the engine's `parallel_state` module that
answers that group and calling the engine's plug-in once with its own EPLB_SERVICE_URL, as an engine's EP ranks
call the policy together. Each rank writes what the plug-in answered and logged, and whether a process it forks
sees no group to run collectives on (`core.engine_group`), to `rank<N>.json`.

Run as `python tests/engine_ranks.py SPEC_FILE RANK` (`run_ranks` does)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"vllm": ("vllm.distributed.parallel_state", "get_ep_group", "vllm.eplb_plugin"),
           "sglang": ("sglang.srt.distributed.parallel_state", "get_world_group", "eplb.integrations.sglang")}
"""engine: (its parallel_state module, the function that answers the ranks' GroupCoordinator, the plug-in's logger)."""


def run_ranks(engine: str, urls: list[str], env: dict[str, str], call: dict[str, Any], tmp: Path,
              timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """One process per rank (len(urls)), rank r with EPLB_SERVICE_URL=urls[r] and `env`, calling the `engine`'s plug-in
    with `call` (vllm: weight, num_replicas, num_groups, num_nodes, num_ranks, old, in the tuple convention; sglang:
    tokens_per_expert, num_physical_experts, num_local_physical_experts, num_groups, num_nodes, current_phy2log); what
    each rank answered: {"maps": [phy2log, log2phy, logcnt], "logs": [[level, message]], "forked_group": bool}."""
    spec = tmp / "ranks.json"
    spec.write_text(json.dumps({"engine": engine, "urls": urls, "env": env, "call": call,
                                "store": str(tmp / "store"), "out": str(tmp)}))
    ranks = [subprocess.Popen([sys.executable, __file__, str(spec), str(r)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(len(urls))]
    outputs = [p.communicate(timeout=timeout_s)[0] for p in ranks]
    for r, (p, out) in enumerate(zip(ranks, outputs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(len(urls))]


def _rank(spec: dict[str, Any], rank: int) -> None:
    import torch
    import torch.distributed as dist

    from eplb.integrations import core

    module, getter, log_name = ENGINES[spec["engine"]]
    os.environ.update({**spec["env"], "EPLB_SERVICE_URL": spec["urls"][rank]})
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=len(spec["urls"]))
    parts = module.split(".")
    for i in range(1, len(parts)):  # the engine's packages, empty, then its parallel_state
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    state = types.ModuleType(module)
    coordinator = types.SimpleNamespace(cpu_group=dist.new_group(backend="gloo"))
    setattr(state, getter, lambda: coordinator)
    sys.modules[module] = state

    logs: list[list[Any]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logs.append([record.levelname, record.getMessage()])

    logger = logging.getLogger(log_name)
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    call = spec["call"]
    if spec["engine"] == "vllm":
        from eplb.integrations.vllm import EplbTuplePolicy

        maps = EplbTuplePolicy.rebalance_experts(torch.tensor(call["weight"]), call["num_replicas"],
                                                 call["num_groups"], call["num_nodes"], call["num_ranks"],
                                                 torch.tensor(call["old"]))
    else:
        from eplb.integrations import sglang

        maps = sglang.rebalance_experts(torch.tensor(call["tokens_per_expert"]), call["num_physical_experts"],
                                        call["num_local_physical_experts"], call["num_groups"], call["num_nodes"],
                                        sglang.EPLB, torch.tensor(call["current_phy2log"]))
    find = getattr(state, getter)
    child = os.fork()
    if child == 0:  # a process the engine forks (an algorithm process) must not use the groups it inherited
        try:
            code = 0 if core.engine_group(lambda: find().cpu_group) is None else 1
        except BaseException:  # whatever it raised, the fork leaves without running its parent's code
            code = 2
        os._exit(code)
    _, status = os.waitpid(child, 0)
    answer = {"maps": [m.tolist() for m in maps], "logs": logs, "forked_group": os.waitstatus_to_exitcode(status) != 0}
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(answer))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _rank(json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2]))
