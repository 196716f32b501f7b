"""RayExecutor's num_cpus, checked before Ray starts: a local Ray of no CPUs ran no task and waited forever."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from eplb.errors import EplbError
from eplb.executor import RayExecutor


@pytest.mark.parametrize("num_cpus", [0, -1, 1.5, 2.0, True, "2"])
def test_a_num_cpus_no_local_ray_can_run_tasks_with_is_refused_at_once(num_cpus: Any) -> None:
    """0 started a Ray of no CPUs whose tasks never ran (map waited forever); -1 and 1.5 reached ray.init, which said
    'Resource quantities must be nonnegative' in Ray's words."""
    with pytest.raises(EplbError, match=r"^num_cpus must be a whole number >= 1 \(the CPUs of the local Ray\), got "):
        RayExecutor(num_cpus=num_cpus)


def test_num_cpus_with_a_cluster_address_is_refused_not_ignored() -> None:
    with pytest.raises(EplbError, match=r"^num_cpus sizes the local Ray eplb starts.*the cluster at 'head:6379'"):
        RayExecutor("head:6379", num_cpus=4)


def test_num_cpus_as_an_int_or_a_numpy_integer_is_taken() -> None:
    assert RayExecutor(num_cpus=np.int64(2)).num_cpus == 2
    assert RayExecutor(num_cpus=None).num_cpus is None


def test_num_cpus_sizes_the_local_ray_of_address_local_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """address "local" starts a new Ray here, as no address does; its num_cpus was dropped (ray.init got None)."""
    import ray

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray, "remote", lambda fn: fn)
    for address in (None, "local"):
        RayExecutor(address, num_cpus=3)._ready()
    assert [(c["address"], c["num_cpus"]) for c in calls] == [("local", 3), ("local", 3)]
