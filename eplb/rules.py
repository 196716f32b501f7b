"""Rules on request fields shared by the service's request models (`api.schemas`), deployments' configs
(`eplb.deployments`) and the light client side (`eplb.integrations`, `eplb.client`): one text each. Light to
import (no numpy, no SQLAlchemy): the engine plug-ins read it."""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from typing import TypeVar
from urllib.parse import urlsplit

from eplb.errors import shown

DEPLOYMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""The names the service gives deployments; match them whole (`is_deployment_name`: fullmatch, so a trailing
newline is no name, as `^...$` with `re.match` let through)."""
DEPLOYMENT_NAME_RULE = "use 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
NAME_SHOWN = 100
"""The most characters of a deployment name a message echoes (`eplb.errors.shown`): any name one can have, whole."""

HISTORY_PAGE_MAX = 1000
JOBS_PAGE_MAX = 1000
"""The most jobs `GET /jobs` lists (`?limit`, 100 by default): finished jobs stay EPLB_JOB_TTL_S and do not count
against EPLB_MAX_JOBS, so a busy hour can keep hundreds of thousands."""
"""The most history entries one page holds (`GET /deployments/{name}/history?limit=`, `eplb deployments history
--limit`); the least is 1."""
MAX_HISTORY_ID = 2**31 - 1
"""The largest history id the store holds (an Integer column: PostgreSQL's int4, which also refuses a larger
parameter; SQLite's are int64): a larger `before` is refused by name, not a database error; the least is 1."""

MAX_TIMEOUT_S = 86_400.0
"""The longest wait for one call to the service, seconds (a day): the Python client's `timeout`, the plug-ins'
EPLB_SERVICE_TIMEOUT_S. A longer one is no wait: httpx cannot set 1e12 s (OverflowError, 'timestamp out of range
for platform time_t'), and no solve of the service takes a day (its time budgets are at most an hour)."""


def timeout_refusal(value: object) -> str | None:
    """Why `value` is no timeout for a call to the service, 'must be ..., got X', or None: a number of seconds above
    0, at most MAX_TIMEOUT_S (0 or less made the socket raise 'Timeout value out of range', inf overflowed)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < float(value) <= MAX_TIMEOUT_S:
        return None
    return f"must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:,.0f} (a day), got {value!r}"


def url_refusal(url: object) -> str | None:
    """Why `url` is no address of the service, 'is no http(s) URL of a host (e.g. http://127.0.0.1:8000), got X',
    or None: http:// or https://, a host and a port (if any) of 0 to 65535 (without the scheme httpx took
    'localhost:8000' as the protocol 'localhost', and 'http://' as a host named 'http:')."""
    if isinstance(url, str):
        try:
            parts = urlsplit(url)
            if parts.scheme in ("http", "https") and parts.hostname and (parts.port or 0) >= 0:
                return None
        except ValueError:  # an unclosed [, a port that is no number or above 65535
            pass
    return f"is no http(s) URL of a host (e.g. http://127.0.0.1:8000), got {shown(url)}"


_SPACES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", " ": "a space"}


def api_key_refusal(key: str) -> str | None:
    """Why `key` cannot be a service's API key, the key not shown ('is blank', 'ends with a newline: ...',
    'has a character that is not printable ASCII ...'), or None. A blank key would switch the service's check on and let
    `Authorization: Bearer` through; HTTP strips a header value's whitespace, so no request matches a key with some
    at an end; httpx (the client, the plug-ins) sends ASCII and the service reads the header as latin-1."""
    if not key.strip():
        return "is blank"
    if key != key.strip():
        ends = [f"{where} with {_SPACES.get(c, 'whitespace')}"
                for where, c in (("starts", key[0]), ("ends", key[-1])) if c.isspace()]
        return f"{' and '.join(ends)}: HTTP strips the whitespace around a header's value"
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:
        return (f"has a character that is not printable ASCII (character {bad + 1} of {len(key)}), which is all an "
                "HTTP header carries")
    return None


CLUSTER_FIELDS = {"num_groups": "cluster.num_groups", "gpus_per_node": "cluster.gpus_per_node"}
"""What the registry's refusals call the cluster settings in the service's JSON (`POST /placement`, a deployment's
config); the CLI keeps its flags."""

T = TypeVar("T")

SERVICE_MAX_GPUS = 4096
"""The most GPUs a cluster of the service may have (`POST /placement`, `POST /evaluate`, a deployment's config:
`eplb.schemas.ClusterRules`), the most slots on one of its GPUs, GPUs per node and nodes a token reaches. It bounds
the work of one request, which shares the service's workers with every other: a greedy solve of the embedded 58 x
256 window on 4,096 GPUs of one slot printed 0.89 s and 81,776 KB (`/usr/bin/time -f "%e s %M KB" eplb solve --gpus
4096 --slots-per-gpu 1`, on the 2-core machine, other work running). The CLI's bound is larger
(`CLI_MAX_GPUS`): a local run spends only its own user's time."""
CLI_MAX_GPUS = 65_536
"""The most GPUs `--gpus` (`eplb solve`, `eplb evaluate`, `eplb replay`), `eplb compare --ep` and the Python API's
`eplb.solve.Cluster` take: a bound on what the C kernels and numpy are given (a huge value crashed them), not on a
run's time, which is its user's own (the solve of SERVICE_MAX_GPUS' note on 65,536 GPUs printed 60.90 s and 725,724
KB: `/usr/bin/time -f "%e s %M KB" eplb solve --gpus 65536 --slots-per-gpu 1`, on the 2-core machine, other work
running). The service, whose workers every request shares, takes at most SERVICE_MAX_GPUS (4,096)."""
SERVICE_MAX_WORK = 2**30
"""The most layers x slots x GPUs (L x P x G) one solve of the service takes (`POST /placement`, a deployment's
window): what the solvers' time grows with, which no other bound caps for the solvers without a time limit (a 5 KB
body of one 1,024-expert layer on 4,096 GPUs of 64 slots is 2**30; 58 layers of 256 experts on 4,096 GPUs of one
slot, 973,078,528, is taken). `work_refusal`; the CLI has no such bound (a local run spends its user's time)."""
SERVICE_MAX_LAYER_SLOTS = 2**22
"""The most layers x slots (the answer's phy2log entries, L x P) one solve of the service writes: 4,194,304."""
SERVICE_MAX_LAYERS = 16_384
"""The most layers one solve of the service takes: each layer has a fixed cost, which the bounds above miss on small
layers (200,000 layers of 8 experts on 4 GPUs, a 5 MB body within them, held a solver process 30.8 s). `eplb synth
--out small.npz --steps 1 --layers 16384 --experts 8 --top-k 2 --tokens 4096`, then `/usr/bin/time -f "%e s %M KB"
eplb solve --loads small.npz --gpus 4 --json` printed 2.83 s and 68,556 KB (the 2-core machine, nothing else
running). No model has a hundredth of it."""
SERVICE_MAX_PAIRS = 2**24
"""The most layers x experts x experts (L x E^2) a co-activation summary given to the service may cover: the
co-activation solvers and the time objective hold the expert pairs of every layer densely, about 50 bytes each
(4 x 2,048 experts, 16,777,216 pairs: `eplb synth --out t.npz --format topk --steps 2 --layers 4 --experts 2048
--tokens 4096`, then `/usr/bin/time -f "%e s %M KB" eplb solve --loads t.npz --coactivation t.npz --solver
greedy-coact --gpus 64` printed 4.93 s and 907,620 KB), and a small body named 65,536 experts. The largest MoE
models are within it: 48 x 512 (12,582,912), 60 x 384, 58 x 256 (3,801,088). `pairs_refusal`."""
MAX_BUDGET_BYTES = 1e15
"""The largest memory budget of one GPU, bytes (a petabyte)."""
BUDGETS = ("slots_per_gpu", "num_redundant", "memory_budget_bytes")
GROUPS_NEED_NODES = ("needs cluster.gpus_per_node: the hierarchical policy keeps each group of experts within a "
                     "node; give both, or neither")


def is_deployment_name(name: str) -> bool:
    return DEPLOYMENT_NAME.fullmatch(name) is not None


def name_refusal(name: str) -> str | None:
    """Why `name` is no deployment name, in one line quoting it (clipped at `NAME_SHOWN`, with its length when
    cut), or None when it is one. The one text of the service, the CLI and the client."""
    if is_deployment_name(name):
        return None
    return f"deployment name {shown(name, NAME_SHOWN)}: {DEPLOYMENT_NAME_RULE}"


def one_budget(cluster: object) -> None:
    """At most one slot budget on a cluster (its fields `BUDGETS`); ValueError otherwise, for a pydantic
    validator on the cluster (so a 422 names the field `cluster`)."""
    given = [n for n in BUDGETS if getattr(cluster, n) is not None]
    if len(given) > 1:
        raise ValueError(f"give only one of {', '.join(BUDGETS)} (got {given})")


def groups_need_nodes(num_groups: int | None, data: dict[str, object]) -> int | None:
    """num_groups only with gpus_per_node (a cluster without nodes would ignore the groups); ValueError
    otherwise, for a pydantic validator of the field num_groups (`data`: the fields validated before it; a
    gpus_per_node that failed its own check is absent, and its error is the one to show), so a 422 names
    cluster.num_groups."""
    if num_groups is not None and "gpus_per_node" in data and data["gpus_per_node"] is None:
        raise ValueError(GROUPS_NEED_NODES)
    return num_groups


def gpu_count_mismatch(count: int, num_gpus: int) -> str | None:
    """What is wrong with `count` values of a per-GPU setting for `num_gpus` GPUs (one value, or one per GPU,
    fits): None when nothing is."""
    if count in (1, num_gpus):
        return None
    return f"got {count} values for {num_gpus} GPUs (give one, or one per GPU)"


def one_per_gpu(values: T, data: Mapping[str, object]) -> T:
    """A per-GPU setting (slots_per_gpu, memory_budget_bytes) holds one value or one per GPU; ValueError
    otherwise, for a pydantic validator of the field (`data`: the fields validated before it; a num_gpus that
    failed its own check is absent, and its error is the one to show), so a 422 names the field."""
    num_gpus = data.get("num_gpus")
    if isinstance(values, list) and isinstance(num_gpus, int):
        wrong = gpu_count_mismatch(len(values), num_gpus)
        if wrong is not None:
            raise ValueError(wrong)
    return values


def work_refusal(layers: int, slots: int, gpus: int) -> str | None:
    """Why a solve of `layers` layers on `slots` slots of `gpus` GPUs is too large for the service, in one line with
    the limit (SERVICE_MAX_LAYERS, SERVICE_MAX_LAYER_SLOTS, SERVICE_MAX_WORK), or None. The fields it is about:
    `work_fields`."""
    what = f"{layers:,} layer{'' if layers == 1 else 's'}"
    if layers > SERVICE_MAX_LAYERS:
        return (f"{what} is above the service's {SERVICE_MAX_LAYERS:,} per solve (eplb.rules.SERVICE_MAX_LAYERS): "
                f"send fewer layers per request, or run eplb solve, which has no such bound")
    if layers * slots > SERVICE_MAX_LAYER_SLOTS:
        return (f"{what} x {slots:,} slots is {layers * slots:,} slots to place, above the service's "
                f"{SERVICE_MAX_LAYER_SLOTS:,} per solve (eplb.rules.SERVICE_MAX_LAYER_SLOTS): send fewer layers or "
                f"slots per request, or run eplb solve, which has no such bound")
    if layers * slots * gpus > SERVICE_MAX_WORK:
        return (f"{what} x {slots:,} slots x {gpus:,} GPUs is {layers * slots * gpus:,}, above the "
                f"service's {SERVICE_MAX_WORK:,} per solve (eplb.rules.SERVICE_MAX_WORK, what a solve's time grows "
                f"with): send fewer layers, GPUs or slots per GPU per request, or run eplb solve, which has no such "
                f"bound")
    return None


def pairs_refusal(layers: int, experts: int) -> str | None:
    """Why the service takes no co-activation summary of `layers` x `experts` (above SERVICE_MAX_PAIRS), in one line
    with the limit, or None."""
    pairs = layers * experts * experts
    if pairs <= SERVICE_MAX_PAIRS:
        return None
    return (f"{layers:,} layer{'' if layers == 1 else 's'} x {experts:,}^2 experts is {pairs:,} expert pairs, above "
            f"the {SERVICE_MAX_PAIRS:,} the service holds per solve (eplb.rules.SERVICE_MAX_PAIRS): send fewer layers "
            "per request, or run eplb solve, which has no such bound")


def work_fields(cluster: object, loads: str | None = "loads") -> list[str]:
    """The fields a solve's size comes from: the window's layers (`loads`; None: not the request's), the cluster's
    GPUs and the slot budget it gives (`BUDGETS`; none given: the default, one redundant expert per GPU)."""
    given = [f"cluster.{name}" for name in BUDGETS if getattr(cluster, name, None) is not None]
    return [*([loads] if loads else []), "cluster.num_gpus", *given]
