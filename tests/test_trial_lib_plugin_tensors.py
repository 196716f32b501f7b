"""The engine plug-ins on tensors a careless caller passes: on the meta device, sparse, of dtypes numpy lacks."""

from __future__ import annotations

import pytest
import torch

from eplb.integrations import core, sglang, vllm

POLICY = vllm.policy_class("tuple")
WEIGHT = torch.arange(16, dtype=torch.float32).reshape(2, 8) + 1
MAP = torch.arange(12).repeat(2, 1) % 8


def test_a_tensor_on_the_meta_device_is_said_to_hold_no_values() -> None:
    """It was 'must be a rectangular array of numbers (a tensor, ...), got a Tensor': a tensor refused for not being
    one."""
    with pytest.raises(core.PolicyInputError, match=r"^weight is a tensor on the meta device, which holds no values"):
        POLICY.rebalance_experts(WEIGHT.to("meta"), 12, 1, 1, 4)
    with pytest.raises(core.PolicyInputError, match=r"^tokens_per_expert is a tensor on the meta device"):
        sglang.rebalance_experts(WEIGHT.to("meta"), 12, 3, None, 1)
    with pytest.raises(core.PolicyInputError, match=r"^old_global_expert_indices is a tensor on the meta device"):
        POLICY.rebalance_experts(WEIGHT, 12, 1, 1, 4, MAP.to("meta"))


def test_sparse_loads_and_maps_are_read_as_their_dense_values() -> None:
    dense = POLICY.rebalance_experts(WEIGHT, 12, 1, 1, 4, MAP)
    sparse = POLICY.rebalance_experts(WEIGHT.to_sparse(), 12, 1, 1, 4, MAP.to_sparse())
    assert [t.tolist() for t in sparse] == [t.tolist() for t in dense]


def test_a_bfloat16_map_is_refused_as_no_integer_ids() -> None:
    """A float32 map was 'must hold integer expert ids', a bfloat16 one 'got a Tensor' (numpy has no bfloat16)."""
    with pytest.raises(core.PolicyInputError, match=r"^old_global_expert_indices must hold integer expert ids"):
        POLICY.rebalance_experts(WEIGHT, 12, 1, 1, 4, MAP.bfloat16())
