"""eplb.evaluate's balance of a placement on loads that are not the placement's layers and experts."""

from __future__ import annotations

import numpy as np
import pytest

from eplb.errors import EplbError
from eplb.evaluate import balance, gpu_loads
from eplb.placement import Placement

PLACEMENT = Placement(np.array([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 2, 3]]), np.array([3, 3]), 4)


@pytest.mark.parametrize("shape", [(2, 5), (1, 4), (3, 4), (4,)])
def test_balance_on_loads_of_another_shape_is_refused_not_broadcast(shape: tuple[int, ...]) -> None:
    """1 layer of loads was broadcast over the placement's 2, and a 5th expert's loads dropped: lb 1 for loads the
    placement is not for (a 1-D row raised numpy's AxisError)."""
    loads = np.arange(1, 1 + int(np.prod(shape)), dtype=np.float64).reshape(shape)
    with pytest.raises(EplbError, match=r"the placement is for 2 layers x 4 experts, the loads are "):
        balance(loads, PLACEMENT)
    with pytest.raises(EplbError, match=r"the placement is for 2 layers x 4 experts"):
        gpu_loads(loads, PLACEMENT)


def test_balance_takes_the_placements_loads_as_lists_too() -> None:
    loads = [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]]
    np.testing.assert_array_equal(balance(loads, PLACEMENT).gpu_loads, balance(np.array(loads), PLACEMENT).gpu_loads)


def test_a_placement_of_no_layers_is_refused_when_it_is_made() -> None:
    """Placement(phy2log of shape [0, 6], ...) was accepted, then log2phy() raised numpy's 'zero-size array to
    reduction operation maximum'."""
    with pytest.raises(EplbError, match=r"^invalid placement: phy2log has no layers: a placement holds at least one "):
        Placement(np.zeros((0, 6), np.int64), np.array([3, 3]), 4)
