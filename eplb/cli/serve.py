"""`eplb serve`: run the placement service (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse

from eplb.errors import EplbError

DESCRIPTION = """\
Run the HTTP placement service. A serving cluster POSTs per-expert loads to /placement and gets a placement
back; /docs has the interactive OpenAPI docs with examples.

Settings come from the environment (EPLB_ prefix): EPLB_API_KEY (when set, requests must send
'Authorization: Bearer KEY' to POST, PUT, PATCH and DELETE routes, GET /jobs and every /deployments route,
reads too; GET /jobs/{id}, /presets, /healthz, /readyz, /metrics and the docs need none; the CLI sends it
with --api-key or EPLB_API_KEY), EPLB_SOLVER_WORKERS, EPLB_QUEUE_LIMIT, EPLB_MAX_BODY_BYTES,
EPLB_ASYNC_THRESHOLD_S, EPLB_MILP_DEFAULT_TIME_LIMIT_S, EPLB_MAX_JOBS, EPLB_JOB_TTL_S, EPLB_RETRY_AFTER_S
(docs/api.md).
Deployments, their history and jobs live in a database: SQLite in EPLB_DATA_DIR (default
~/.local/share/eplb), or PostgreSQL at EPLB_DATABASE_URL, migrated at start; several `eplb serve` processes
on one database share them (EPLB_JOB_LEASE_S: a dead replica's jobs fail after this many seconds).
Scale solving with --workers (solver processes)."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `serve` subcommand."""
    p = subparsers.add_parser("serve", help="run the HTTP placement service", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="solver processes (default: EPLB_SOLVER_WORKERS or the CPU count)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from api.database import create_service
    from api.settings import Settings
    from eplb.cli import settings_error
    from eplb.store import StoreSettings

    if not 0 < args.port < 65536:
        raise EplbError(f"--port must be 1-65535, got {args.port}")
    try:
        settings = Settings() if args.workers is None else Settings(solver_workers=args.workers)
    except ValidationError as exc:
        raise settings_error(exc, Settings, {} if args.workers is None else {"solver_workers": "--workers"}) from None
    try:
        StoreSettings()  # EPLB_DATABASE_URL, EPLB_DATA_DIR, EPLB_JOB_LEASE_S: read again where the store opens
    except ValidationError as exc:
        raise settings_error(exc, StoreSettings) from None
    uvicorn.run(create_service(settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0
