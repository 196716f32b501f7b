"""The error types: what users see, and what crosses process boundaries."""

from __future__ import annotations

import pickle

import pytest

from eplb.errors import EplbError, FieldError


@pytest.mark.parametrize("error", [
    FieldError("cluster.num_groups", "needs cluster.gpus_per_node"),
    FieldError(["solver", "objective"], "choose another solver"),
    FieldError("loads", "loads must be >= 0", "loads[0][1] is -2: loads must be >= 0"),
])
def test_a_field_error_survives_pickling(error: FieldError) -> None:
    """args held only the text, so unpickling called FieldError(text) and failed (message missing): a FieldError
    raised in a solver process could not come back. Its fields, message and text survive the round trip."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is FieldError and isinstance(back, EplbError)
    assert (back.fields, back.message, str(back)) == (error.fields, error.message, str(error))
