"""`eplb deployments list|show|history` and `eplb history NAME --plot FILE`: read deployments from a running
service (--url) or straight from its database (--database-url, default EPLB_DATABASE_URL or the SQLite file
in EPLB_DATA_DIR)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from eplb.cli import clip
from eplb.errors import EplbError
from eplb.io.files import plural
from eplb.io.images import IMAGE_HELP, image_format, save_figure
from eplb.rules import HISTORY_PAGE_MAX, MAX_HISTORY_ID, api_key_refusal, name_refusal, url_refusal

if TYPE_CHECKING:  # imported when a command runs: SQLAlchemy costs every other command its start-up time
    from matplotlib.figure import Figure

    from eplb.client import Client, ServiceError
    from eplb.deployments import DeploymentView, HistoryEntry, HistoryPage
    from eplb.store import Store, StoreSettings

GIB = 1024**3
PAGE_FLAGS = {"limit": ("--limit", HISTORY_PAGE_MAX, "entries per page"),
              "before": ("--before", MAX_HISTORY_ID, "entries older than this history id, a page's next")}
"""The paging flags of `history`, by the service's query parameter: the flag, its largest value (the least is
1) and what it means."""
WHERE = ("point at the service's database with --database-url URL, EPLB_DATABASE_URL or EPLB_DATA_DIR (the "
         "directory holding its eplb.db), or ask the running service with --url URL")


class _Source:
    """Deployments from the service (HTTP) or from the database, as the same models."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.url, self.database_url = args.url, args.database_url
        given = args.api_key is not None  # --api-key "" is refused as blank, not taken as not given
        self.api_key = args.api_key if given else os.environ.get("EPLB_API_KEY") or None
        self.key_source = "--api-key" if given else "EPLB_API_KEY" if self.api_key else None
        if self.url is not None and self.database_url:
            raise EplbError("give --url or --database-url, not both")
        refused_url = None if self.url is None else url_refusal(self.url)
        if refused_url is not None:  # '' had read the database; 'localhost:8000' was 'cannot reach'
            raise EplbError(f"--url {refused_url}")
        refused = None if self.api_key is None or not self.url else api_key_refusal(self.api_key)
        if refused is not None:  # before any request, in the CLI's words (the client's name its api_key argument)
            raise EplbError(f"{self.key_source} (not shown) {refused}: give the key the service runs with (its "
                            "EPLB_API_KEY)")
        self._opened: Store | None = None

    def list(self) -> list[DeploymentView]:
        if self.url:
            with self._asking() as client:
                return client.deployments()
        from eplb import deployments

        return deployments.list_all(self._store())

    def show(self, name: str) -> DeploymentView:
        if self.url:
            with self._asking() as client:
                return client.deployment(name)
        from eplb import deployments

        return deployments.get(self._store(), name)

    def history(self, name: str, limit: int, before: int | None) -> HistoryPage:
        if self.url:
            with self._asking({"limit": limit, "before": before}) as client:
                return client.history(name, limit, before)
        from eplb import deployments

        return deployments.history(self._store(), name, limit, before)

    def all_history(self, name: str) -> Iterator[HistoryEntry]:
        before = None
        while True:
            page = self.history(name, HISTORY_PAGE_MAX, before)
            yield from page.entries
            if page.next is None:
                return
            before = page.next

    @contextmanager
    def _asking(self, query: dict[str, Any] | None = None) -> Iterator[Client]:
        """A client of the service; its 401 and its 422 on a query parameter (`query`: the values sent) said in the
        CLI's words (`refusal`)."""
        from eplb.client import Client, ServiceError

        with Client(self.url, api_key=self.api_key) as client:
            try:
                yield client
            except ServiceError as exc:
                raise refusal(exc, self.url, self.key_source, query or {}) from None

    def _store(self) -> Store:
        """The database, opened to read only: one that does not exist is refused, naming it, never created."""
        from pydantic import ValidationError

        from eplb.cli import settings_error
        from eplb.store import MissingDatabase, StoreSettings, database_url, open_existing

        if self._opened is None:
            try:
                settings = StoreSettings()
            except ValidationError as exc:
                raise settings_error(exc, StoreSettings) from None
            try:
                self._opened = open_existing(self.database_url or database_url(settings))
            except MissingDatabase as exc:
                raise EplbError(f"{exc}; it came from {self._origin(settings)}: {WHERE}") from None
        return self._opened

    def _origin(self, settings: StoreSettings) -> str:
        """Where the database URL came from, for a refusal."""
        if self.database_url:
            return "--database-url"
        if settings.database_url:
            return "EPLB_DATABASE_URL"
        if any(k.upper() == "EPLB_DATA_DIR" for k in os.environ):
            return f"EPLB_DATA_DIR={str(settings.data_dir)!r}"
        return f"the default data directory {settings.data_dir} (EPLB_DATA_DIR is not set)"


def refusal(exc: ServiceError, url: str, key_source: str | None, query: dict[str, Any]) -> EplbError:
    """A problem the service answered, in the CLI's words: a 401 names --api-key and EPLB_API_KEY (the service's
    own text names an HTTP header), a 422 on a query parameter names its flag, the value and the flag's range;
    any other problem as the service said it."""
    if exc.status == 401:
        if key_source is None:
            return EplbError(f"the service at {url} needs its API key: give --api-key KEY or set EPLB_API_KEY")
        return EplbError(f"the service at {url} refused the API key from {key_source}: give the key the service "
                         "runs with (its EPLB_API_KEY) with --api-key KEY or EPLB_API_KEY")
    if exc.status == 422:
        flagged = []
        for err in exc.errors:
            field = str(err.get("field") or "") if isinstance(err, dict) else ""
            param = field.removeprefix("query.")
            if field.startswith("query.") and param in PAGE_FLAGS:
                flag, most, what = PAGE_FLAGS[param]
                flagged.append(f"{flag} {query.get(param)}: the service at {url} refuses it "
                               f"({' '.join(str(err.get('message', '')).split())}); give 1 to {most} ({what})")
        if flagged:
            return EplbError("; ".join(flagged))
    return exc


def _source_args(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("where the deployments are")
    src.add_argument("--url", metavar="URL", help="a running service, e.g. http://127.0.0.1:8000")
    src.add_argument("--api-key", metavar="KEY", help="the service's API key (default: EPLB_API_KEY)")
    src.add_argument("--database-url", metavar="URL",
                     help="the service's database (default: EPLB_DATABASE_URL, else SQLite in EPLB_DATA_DIR)")


def _history_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="deployment name")
    p.add_argument("--limit", type=int, default=50, metavar="N",
                   help=f"entries to show, newest first: 1 to {HISTORY_PAGE_MAX} (default 50)")
    p.add_argument("--before", type=int, metavar="ID",
                   help=f"entries older than this history id (a page's next): 1 to {MAX_HISTORY_ID}")
    p.add_argument("--json", action="store_true", help="print the page as JSON")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `deployments` (list, show, history) and `history`."""
    p = subparsers.add_parser("deployments", help="list and inspect the deployments the service remembers",
                              description=__doc__)
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("list", help="every deployment: model, GPUs, slots, windows, last placement (placed or "
                        "rebalanced)")
    ls.add_argument("--json", action="store_true", help="print the deployments as JSON")
    show = sub.add_parser("show", help="one deployment's config and current placement")
    show.add_argument("name", metavar="NAME")
    show.add_argument("--json", action="store_true", help="print the deployment (with its placement) as JSON")
    hist = sub.add_parser("history", help="one deployment's events, newest first")
    _history_args(hist)
    for q in (ls, show, hist):
        _source_args(q)
    ls.set_defaults(func=run_list)
    show.set_defaults(func=run_show)
    hist.set_defaults(func=run_history)

    h = subparsers.add_parser("history", help="a deployment's history; --plot draws predicted lb and moves",
                              description="A deployment's events, newest first; with --plot, an image of the "
                              "predicted lb before and after each window, the lb of each placement the cluster "
                              "reported applied, and the expert copies of each event.")
    _history_args(h)
    h.add_argument("--plot", metavar="FILE", help=f"draw the whole history into FILE, {IMAGE_HELP}")
    _source_args(h)
    h.set_defaults(func=run_history)


def _checked_name(name: str) -> str:
    """`name` when a deployment can have it; else EplbError quoting it clipped (`eplb.rules.name_refusal`, the
    service's text)."""
    refused = name_refusal(name)
    if refused is not None:
        raise EplbError(refused)
    return name


def _check_page(args: argparse.Namespace) -> None:
    """--limit and --before within what the service and the database take, whichever answers."""
    for param, (flag, most, what) in PAGE_FLAGS.items():
        value = getattr(args, param)
        if value is not None and not 1 <= value <= most:
            raise EplbError(f"{flag} must be 1 to {most} ({what}), got {value}")


def run_list(args: argparse.Namespace) -> int:
    views = _Source(args).list()
    if args.json:
        print(json.dumps([v.model_dump(mode="json", exclude={"placement"}) for v in views], indent=2))
        return 0
    if not views:
        print("no deployments")
        return 0
    print(f"{'name':<24} {'model':<20} {'hardware':<9} {'GPUs':>5} {'slots':>6} {'windows':>8} "
          f"{'last placement':>15} {'trigger':<9}")
    for v in views:
        last = "-" if v.last_rebalance is None else f"{v.last_placement or 'window'} #{v.last_rebalance}"
        print(f"{clip(v.name, 24):<24} {clip(v.config.model, 20):<20} {clip(v.config.hardware, 9):<9} "
              f"{v.config.cluster.num_gpus:>5} {_slots(v):>6} {v.windows:>8} {last:>15} {v.config.policy.trigger:<9}")
    return 0


def _last_placement(view: DeploymentView) -> str:
    """The last placement the service made, in words: placed or rebalanced, at which window (a service older than
    `last_placement` says only the window)."""
    if view.last_rebalance is None:
        return "no placement made yet"
    if view.last_placement == "placed":
        return f"placed at window {view.last_rebalance}"
    if view.last_placement == "rebalanced":
        return f"last rebalanced at window {view.last_rebalance}"
    return f"last new placement at window {view.last_rebalance}"


def _slots(view: DeploymentView) -> str:
    """The slots of the serving placement, else those its config fixes ('-' for a config this version cannot
    resolve, e.g. a model preset it does not have)."""
    if view.placement is not None:
        return str(sum(view.placement.slots_per_gpu))
    from eplb.deployments import config_slots

    try:
        return str(int(config_slots(view.config).sum()))
    except (EplbError, KeyError):
        return "-"


def run_show(args: argparse.Namespace) -> int:
    view = _Source(args).show(_checked_name(args.name))
    if args.json:
        print(json.dumps(view.model_dump(mode="json", exclude_none=True), indent=2))
        return 0
    print(f"deployment {view.name}: {plural(view.windows, 'window')}, {_last_placement(view)}")
    print(f"  created {_when(view.created_at)}, updated {_when(view.updated_at)}")
    print("  config " + json.dumps(view.config.model_dump(mode="json", exclude_none=True)))
    if view.placement is None:
        print(f"  placement: none yet ({_slots(view)} slots when the next window places it)")
    else:
        p = view.placement
        print(f"  placement: {plural(len(p.phy2log), 'layer')}, {plural(p.num_experts, 'expert')} on "
              f"{plural(p.num_gpus, 'GPU')}, {plural(sum(p.slots_per_gpu), 'slot')} (show --json prints phy2log)")
    return 0


def run_history(args: argparse.Namespace) -> int:
    name = _checked_name(args.name)
    _check_page(args)
    plot = getattr(args, "plot", None)
    if plot is not None:
        image_format(plot, "--plot")  # refused before anything is read
    source = _Source(args)
    if plot is not None:
        entries = list(source.all_history(name))
        image = save_figure(history_figure(name, entries), plot, "--plot")
        print(f"wrote {plot} ({image.upper()}, {plural(len(entries), 'event')})")
        return 0
    page = source.history(name, args.limit, args.before)
    if args.json:
        print(json.dumps(page.model_dump(mode="json", exclude_none=True), indent=2))
        return 0
    print(f"{'id':>6} {'window':>6} {'time':<19} {'action':<10} {'lb before':>9} {'lb after':>9} "
          f"{'step us before':>14} {'after':>9} {'moves':>6} {'GiB':>7} {'solver':<12} reason")
    for e in page.entries:
        print(f"{e.id:>6} {e.seq:>6} {_when(e.at):<19} {e.action:<10} {_num(e.lb_before, 4):>9} "
              f"{_num(e.lb_after, 4):>9} {_num(e.time_before_us, 1):>14} {_num(e.time_after_us, 1):>9} "
              f"{_num(e.moves, 0):>6} {_num(None if e.bytes_moved is None else e.bytes_moved / GIB, 2):>7} "
              f"{(e.solver or '-'):<12} {e.reason}")
    if page.next is not None:
        print(f"(older: --before {page.next})")
    return 0


ACTION_COLORS = {"placed": "tab:green", "rebalanced": "tab:blue", "kept": "lightgrey", "applied": "tab:orange"}


def history_figure(name: str, entries: list[HistoryEntry]) -> Figure:
    """The history plot, oldest first: top, the predicted lb (mean over layers) of the serving placement before
    each window and after its decision, and of each placement the cluster reported applied (judged on the last
    window); bottom, the expert copies of each event, the events of one window side by side. Windows on the
    x axis and copies are whole numbers; the legends sit right of the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not entries:
        raise EplbError(f"deployment {name!r} has no history to plot")
    entries = sorted(entries, key=lambda e: e.id)
    windows = [e for e in entries if e.action != "applied"]
    applied = [e for e in entries if e.action == "applied"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, height_ratios=[2, 1], layout="constrained")
    top.plot([e.seq for e in windows], [e.lb_before for e in windows], "o-", color="tab:red", ms=3,
             label="serving placement,\nbefore the window")
    top.plot([e.seq for e in windows], [e.lb_after for e in windows], "o-", color="tab:blue", ms=3,
             label="after the decision")
    if applied:
        top.plot([e.seq for e in applied], [e.lb_after for e in applied], "D", color=ACTION_COLORS["applied"],
                 ms=7, mfc="none", mew=1.5, label="applied by the cluster")
    top.axhline(1.0, color="grey", lw=0.8, ls=":")
    top.set_ylabel("predicted lb (mean over layers)")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    top.set_title(f"deployment {name}: predicted load balance and expert copies per window")
    by_window: dict[int, list[HistoryEntry]] = {}
    for e in entries:
        by_window.setdefault(e.seq, []).append(e)
    width = 0.8
    for action, color in ACTION_COLORS.items():
        xs, heights, widths = [], [], []
        for seq, events in by_window.items():
            for i, e in enumerate(events):
                if e.action == action:
                    w = width / len(events)
                    xs.append(seq - width / 2 + (i + 0.5) * w)
                    heights.append(e.moves or 0)
                    widths.append(w)
        if xs:
            bottom.bar(xs, heights, width=widths, color=color, edgecolor="black", linewidth=0.3, label=action)
    bottom.set_ylabel("expert copies")
    bottom.set_xlabel("window")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _num(value: float | int | None, digits: int) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if digits else str(int(value))
