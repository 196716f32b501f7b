"""Service settings, read from the environment with the `EPLB_` prefix (e.g. `EPLB_API_KEY`)."""

from __future__ import annotations

import os

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.inline import SOLVERS as INLINE_SOLVERS
from eplb.errors import SECRET_REFUSED, SETTING_REFUSED, shown
from eplb.rules import api_key_refusal

"""What a key's leading or trailing whitespace is called in its refusal (any other: 'whitespace')."""


class Settings(BaseSettings):
    """Every field can be set as EPLB_<FIELD> (upper case) in the environment."""

    model_config = SettingsConfigDict(env_prefix="EPLB_", hide_input_in_errors=True)  # no key in an error's text

    api_key: str | None = Field(None, description="when set, POST, PUT, PATCH and DELETE routes, GET /jobs and every "
                                "/deployments route need 'Authorization: Bearer <key>'")
    solver_workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1, description="solver processes")
    queue_limit: int = Field(8, ge=0, description="solves that may wait for a worker before 503")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    async_threshold_s: float = Field(10.0, ge=0, description="MILP requests with a longer budget run as jobs")
    milp_default_time_limit_s: float = Field(30.0, gt=0, description="MILP budget when a request gives none")
    max_jobs: int = Field(64, ge=1, description="jobs queued or running at once (finished ones do not count)")
    job_ttl_s: float = Field(3600.0, gt=0, description="finished jobs are forgotten after this many seconds")
    retry_after_s: int = Field(5, ge=1, description="Retry-After on 503")
    inline_solvers: str = Field(
        ",".join(INLINE_SOLVERS),
        description="comma-separated solvers whose small synchronous requests run in the server process's threads, "
        f"some of {', '.join(INLINE_SOLVERS)} (empty: every request goes to the solver processes)",
    )
    inline_max_bytes: int = Field(1024 * 1024, ge=0, description="larger bodies go to the parser and solver processes")
    inline_max_work: int = Field(2**21, ge=0, description="larger solves (layers x slots x GPUs) go to the solver "
                                 "processes, so they never hold the fast lane")
    inline_threads: int = Field(1, ge=1, description="threads of the fast lane in the server process (they share "
                                "one GIL: beyond them, fast requests go to idle solver processes)")

    @field_validator("api_key")
    @classmethod
    def _key_not_blank(cls, key: str | None) -> str | None:
        """`eplb.rules.api_key_refusal`: a key no request could send (a blank one would let `Bearer` through)."""
        refused = None if key is None else api_key_refusal(key)
        if refused == "is blank":
            raise PydanticCustomError(SETTING_REFUSED, "give a key that is not blank, or leave EPLB_API_KEY unset "
                                      "for a service that asks for none")
        if refused is not None:
            remedy = ("remove it (a key file's trailing newline: EPLB_API_KEY=\"$(cat FILE)\" drops it)"
                      if "HTTP strips" in refused else "use printable ASCII")
            raise PydanticCustomError(SECRET_REFUSED, "the key (not shown) {why}, so no client could send this key; "
                                      "{remedy}", {"why": refused, "remedy": remedy})
        return key

    @field_validator("inline_solvers")
    @classmethod
    def _inline_solvers_known(cls, value: str) -> str:
        """Only the solvers of `api.inline.SOLVERS` may run in the server process, and every item names one."""
        names = [name.strip() for name in value.split(",")] if value.strip() else []
        others = [shown(name) for name in names if name and name not in INLINE_SOLVERS]
        said = ([f"{', '.join(others)} cannot run in the server process"] if others else []) + (
            ["an item is empty"] if "" in names else [])
        if said:
            raise PydanticCustomError(SETTING_REFUSED, "{said}; give a comma-separated list of some of {accepted}, "
                                      "or nothing (every request in the solver processes)",
                                      {"said": " and ".join(said), "accepted": ", ".join(INLINE_SOLVERS)})
        return value

    @property
    def inline(self) -> frozenset[str]:
        """The solvers of the in-process lane."""
        return frozenset(name.strip() for name in self.inline_solvers.split(",") if name.strip())
