"""The tables: deployments (config and current placement), their history (one row per window or applied
placement), and jobs (background solves any replica can read and cancel).

Times are Unix seconds (float); arrays are `eplb.store.arrays` blobs. The Alembic revisions in
`migrations/versions` create exactly these tables (tests compare the two)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    """The declarative base whose metadata the migrations track."""


class DeploymentRow(Base):
    """A registered serving cluster. config: the `DeploymentConfig` JSON object; phy2log: [layers, slots] of
    the placement now serving (None until the first window or an applied placement); windows: windows
    received; last_rebalance: the window number of the last new placement; last_window_key: sha256 hex of the
    last processed window's key and of this row's state after it (`eplb.deployments.process_window`: the same
    window sent again while nothing changed is answered `last_window_answer`, its answer as zlib-compressed
    JSON)."""

    __tablename__ = "deployments"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    phy2log: Mapped[bytes | None] = mapped_column(LargeBinary)
    shares: Mapped[bytes | None] = mapped_column(LargeBinary)
    windows: Mapped[int] = mapped_column(Integer, default=0)
    last_rebalance: Mapped[int | None] = mapped_column(Integer)
    last_window_key: Mapped[str | None] = mapped_column(String(64))
    last_window_answer: Mapped[bytes | None] = mapped_column(LargeBinary, deferred=True)  # read by windows only
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class HistoryRow(Base):
    """One event of a deployment. action: placed (first placement), rebalanced, kept (window, no change) or
    applied (what the cluster reported serving). lb_*: mean over layers of the predicted lb on the window,
    before (the serving placement) and after; time_*_us: predicted MoE time of one step (sum over layers);
    loads: the window, a [layers, E] tokens blob; phy2log/shares: the placement after, when it changed; plan: the
    migration plan (JSON), when the solver gave one."""

    __tablename__ = "history"
    __table_args__ = (Index("ix_history_deployment_id", "deployment", "id"),
                      {"sqlite_autoincrement": True})  # ids never reused after a delete (migration 0005)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment: Mapped[str] = mapped_column(String(100), ForeignKey("deployments.name", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)
    action: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    window_digest: Mapped[str | None] = mapped_column(String(64))
    window_layers: Mapped[int | None] = mapped_column(Integer)
    window_experts: Mapped[int | None] = mapped_column(Integer)
    window_tokens: Mapped[float | None] = mapped_column(Float)
    lb_before: Mapped[float | None] = mapped_column(Float)
    lb_after: Mapped[float | None] = mapped_column(Float)
    time_before_us: Mapped[float | None] = mapped_column(Float)
    time_after_us: Mapped[float | None] = mapped_column(Float)
    moves: Mapped[int | None] = mapped_column(Integer)
    bytes_moved: Mapped[float | None] = mapped_column(Float)
    solver: Mapped[str | None] = mapped_column(String(40))
    solver_status: Mapped[str | None] = mapped_column(String(40))
    wall_ms: Mapped[float | None] = mapped_column(Float)
    loads: Mapped[bytes | None] = mapped_column(LargeBinary)
    phy2log: Mapped[bytes | None] = mapped_column(LargeBinary)
    shares: Mapped[bytes | None] = mapped_column(LargeBinary)
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    coactivation: Mapped[bytes | None] = mapped_column(LargeBinary)  # the window's summary, if it carried one


class JobRow(Base):
    """A background solve. owner: the replica running it; lease_until: the owner renews it while the job is
    queued or running, and any replica marks the job failed once it lapses (the owner died). result: the
    answer as zlib-compressed JSON; error: a problem-details object."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    owner: Mapped[str] = mapped_column(String(64))
    lease_until: Mapped[float] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    result: Mapped[bytes | None] = mapped_column(LargeBinary)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
