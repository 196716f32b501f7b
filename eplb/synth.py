"""Synthetic expert loads.

`seed004_counts()` rebuilds, call for call, the routing simulation of the DP+EP article's section 5.2
(our seed 004): power-law expert popularity with exponent 0.4, shuffled over expert ids, 4096 tokens
each picking 8 distinct experts out of 256 with Python's `random` seeded with 0. Its published output
(hottest expert 640 tokens, coldest 67, mean 128) is the check that the counts are the same.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.budget import spread_evenly
from eplb.errors import EplbError
from eplb.io.files import plural
from eplb.io.logs import count_dtype
from eplb.io.windows import MAX_LOAD
from eplb.specs import model_preset

SEED004_TABLE = {
    # EP: (contiguous, load-sorted without redundancy, one redundant expert per GPU), seed 004 section 5.2
    8: (1.14, 1.01, 1.00),
    32: (1.41, 1.17, 1.00),
    64: (1.93, 1.64, 1.00),
    256: (5.00, 5.00, 1.01),
}


def seed004_counts(
    num_experts: int = 256, top_k: int = 8, tokens: int = 4096, skew: float = 0.4, seed: int = 0
) -> NDArray[np.int64]:
    """Tokens routed to each expert in one step: [num_experts], as seed 004 section 5.2 draws them."""
    rng = random.Random(seed)
    popularity = [1 / (rank + 1) ** skew for rank in range(num_experts)]
    rng.shuffle(popularity)
    experts = range(num_experts)
    counts = [0] * num_experts
    for _ in range(tokens):
        picked: set[int] = set()
        while len(picked) < top_k:
            picked.add(rng.choices(experts, weights=popularity)[0])
        for e in picked:
            counts[e] += 1
    return np.asarray(counts, dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Synthetic routing logs (`eplb synth`)
# --------------------------------------------------------------------------------------------

_CALIBRATION_SEED = 20_040_506  # fixed: the exponent a hot ratio maps to does not depend on --seed
_CALIBRATION_LAYERS = 512
_PICKS_PER_EXPERT = 780  # ESFT DeepSeek-V2-Lite logs: about 8,300 tokens x 6 picks / 64 experts
MAX_EXPONENT = 1000
"""The steepest power law `SynthConfig` takes: the second-hottest expert's popularity is 2**-1000 (1e-301) of the
hottest's; steeper ones underflow it to 0, and the log's log-popularities overflowed past 1e306."""
COACT_STD_MAX = 16.0
"""The strongest co-activation `coact_std_for_partner_lift` tries: past it the partner lift grows by a few hundredths
while the token types turn into fixed sets of experts."""


@dataclass(frozen=True)
class SynthConfig:
    """A synthetic routing log: per-step expert counts [steps, layers, experts].

    Each layer l has its own power-law popularity over a random ranking of its experts (its own hot
    set): log p_l(e) = -a log(rank_l(e) + 1) + group_l(e) + drift_std x_l(e, t), normalised.
    - a: `exponent`, or solved from `hot_ratio` (median over layers of the hottest expert's
      popularity / the mean popularity, group and drift effects included; sampling noise not);
    - group_l: DeepSeek-style expert groups (`groups` equal runs of ids) each get a log-normal
      factor with std `group_std`: node-limited routing makes groups hot or cold together;
    - x: an Ornstein-Uhlenbeck process per expert, stationary std 1, correlation time
      `drift_steps` steps: the slow drift that reshuffles the hot set over tens to hundreds of steps;
    - regime shifts (a domain switch) at the steps in `shift_at` and, when `shift_every` > 0, at
      random times `shift_every` steps apart on average: every layer draws a new ranking and new
      group factors;
    - sampling noise: each step routes `tokens` x `top_k` assignments per layer as a multinomial
      over p, except where k distinct experts per token bind (`_Popularity.sample`: an expert with
      top_k p > 1, or a draw above `tokens`): there each token picks top_k distinct experts with the
      inclusion probabilities min(1, c p), c such that they sum to top_k. Either way an expert's expected
      count is tokens x `_inclusions(p)`, whose median hottest / mean over layers is the popularity's as long
      as hot_ratio <= experts / top_k (only layers above that are capped);
    - token-level logs (`synth_topk`): each token picks top_k distinct experts by Gumbel top-k of per-step
      logits solved (`_token_logits`) so that each expert's expected picks are the same tokens x
      `_inclusions(p)`: both formats have the same expected counts, hence the same hot ratio;
    - co-activation (token-level logs only): each token is of one of `coact_clusters`
      latent types, drawn uniformly per token, and type z adds coact_std x u_l(z, e) to its logits
      (u standard normal per layer, type and expert, fixed for the log), so experts favoured
      by the same type are chosen together; the logits are solved for the average over the types. coact_std is
      `coact_std`, or solved from `partner_lift`
      (`eplb.coactivation.partner_lift`: tokens an expert shares with its E/8 most frequent partners over
      what independent picks would share; 1 = independent); the default 2.27 is the mean of
      DeepSeek-V2-Lite's four ESFT task logs (1.90 to 2.59, docs/cost-model.md "Co-activation").
      coact_clusters = 0 gives independent picks.
    Everything is deterministic by `seed`, and a longer log with the same seed starts with the
    shorter one.
    """

    steps: int = 4000
    layers: int = 58
    experts: int = 256
    top_k: int = 8
    tokens: int = 4096
    exponent: float | None = None
    hot_ratio: float = 11.0
    groups: int = 8
    group_std: float = 0.35
    drift_std: float = 0.6
    drift_steps: float = 300.0
    shift_at: tuple[int, ...] = ()
    shift_every: float = 0.0
    seed: int = 0
    model: str | None = "deepseek-v3"
    coact_clusters: int = 16
    partner_lift: float = 2.27
    coact_std: float | None = None

    def check(self, names: Mapping[str, str] | None = None) -> None:
        """Raise EplbError on settings that cannot make a log. names: what the messages call each field (the
        CLI: its flags, `eplb.cli.replay.SYNTH_FLAGS`); by default `synth: FIELD`."""

        def n(field: str) -> str:
            return names[field] if names and field in names else f"synth: {field}"

        for name in ("steps", "layers", "experts", "top_k", "tokens", "groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise EplbError(f"{n(name)} must be a positive integer, got {v!r}")
        if self.tokens * self.top_k > MAX_LOAD:  # numpy's multinomial took no more than an int64 of picks
            raise EplbError(f"{n('tokens')} {self.tokens} x {n('top_k').removeprefix('synth: ')} {self.top_k}: more "
                            f"picks per layer and step than a count holds (at most {MAX_LOAD:,.0f})")
        if self.top_k > self.experts:
            raise EplbError(f"{n('top_k')} ({self.top_k}) must not exceed {n('experts').removeprefix('synth: ')} "
                            f"({self.experts})")
        if self.experts % self.groups:
            raise EplbError(f"{n('groups')} {self.groups}: {plural(self.experts, 'expert')} "
                            f"{'does' if self.experts == 1 else 'do'} not split into {self.groups} equal groups")
        for name in ("group_std", "drift_std", "shift_every"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise EplbError(f"{n(name)} must be >= 0, got {v!r}")
        if not self.drift_steps > 0:
            raise EplbError(f"{n('drift_steps')} must be > 0, got {self.drift_steps!r}")
        if self.exponent is not None and not (math.isfinite(self.exponent) and 0 <= self.exponent <= MAX_EXPONENT):
            raise EplbError(f"{n('exponent')} must be >= 0 and at most {MAX_EXPONENT:,} (steeper changes nothing: "
                            f"the next expert's popularity is below 1e-300 of the hottest's), got {self.exponent!r}")
        if self.exponent is None and not (math.isfinite(self.hot_ratio) and self.hot_ratio >= 1):
            raise EplbError(f"{n('hot_ratio')} must be >= 1 (hottest / mean), got {self.hot_ratio!r}")
        for at in self.shift_at:
            if not 0 <= at < self.steps:
                raise EplbError(f"{n('shift_at')} {at}: a regime shift happens at a step of the log, 0 .. "
                                f"{self.steps - 1} ({n('steps').removeprefix('synth: ')} {self.steps})")
        twice = next((at for i, at in enumerate(self.shift_at) if at in self.shift_at[:i]), None)
        if twice is not None:  # one shift, not two: the second draw of the regime would be silently lost
            raise EplbError(f"{n('shift_at')} {twice}: the step is given twice; give each shift once")
        if not isinstance(self.coact_clusters, int) or self.coact_clusters < 0:
            raise EplbError(f"{n('coact_clusters')} must be an integer >= 0, got {self.coact_clusters!r}")
        if self.coact_std is not None and not (math.isfinite(self.coact_std) and self.coact_std >= 0):
            raise EplbError(f"{n('coact_std')} must be >= 0, got {self.coact_std!r}")
        if self.coact_std is None and not (math.isfinite(self.partner_lift) and self.partner_lift >= 1):
            raise EplbError(f"{n('partner_lift')} must be >= 1 (1 = independent picks), got {self.partner_lift!r}")

    def check_model(self, names: Mapping[str, str] | None = None) -> None:
        """Raise EplbError when `model` is a preset whose shape this log's disagrees with (`check_model_shape`);
        names as `check`'s (the CLI's flags). Not part of `check`: a config made for its arrays alone keeps the
        default model's name whatever its shape."""
        check_model_shape(self.model, self.layers, self.experts, self.top_k, names)

    def resolved_exponent(self) -> float:
        """The power-law exponent a: `exponent`, or the one that gives `hot_ratio`."""
        if self.exponent is not None:
            return float(self.exponent)
        return exponent_for_hot_ratio(self.hot_ratio, self.experts, self.groups, self.group_std, self.drift_std,
                                      self.top_k)

    def resolved_coact_std(self) -> float:
        """The co-activation strength: `coact_std`, or the one that gives `partner_lift` (0 without clusters)."""
        if self.coact_clusters == 0:
            return 0.0
        if self.coact_std is not None:
            return float(self.coact_std)
        key = SynthConfig(
            experts=self.experts, top_k=self.top_k, exponent=self.exponent, hot_ratio=self.hot_ratio,
            groups=self.groups, group_std=self.group_std, drift_std=self.drift_std,
            coact_clusters=self.coact_clusters, partner_lift=self.partner_lift,
        )
        return coact_std_for_partner_lift(key)

    @property
    def count_dtype(self) -> np.dtype[Any]:
        """The writers' type (`eplb.io.logs.count_dtype`) for counts of at most a layer's assignments in one step,
        tokens x top_k: uint16 when they fit."""
        return count_dtype(self.tokens * self.top_k)


def check_model_shape(
    model: str | None, layers: int, experts: int, top_k: int, names: Mapping[str, str] | None = None
) -> None:
    """EplbError when `model`, the name a synthetic log will carry, is a model preset (`model_preset`) its log cannot
    be of: other routed experts, or more layers than its MoE layers (`ModelSpec.window_mismatch`, the rule `eplb
    replay` and `eplb solve` then refuse the log by), or another top-k. A name that is no preset is left alone.
    names: what the message calls "model", "layers", "experts" and "top_k" (default `synth: FIELD`)."""
    preset = model_preset(model)
    if preset is None:
        return

    def n(field: str) -> str:
        return names[field] if names and field in names else f"synth: {field}"

    why = preset.window_mismatch(layers, experts, "the log would have", {s: n(s) for s in ("experts", "layers")})
    if why is None and top_k != preset.top_k:
        why = f"the log would route top-{top_k} ({n('top_k')}), but model {preset.name!r} routes top-{preset.top_k}"
    if why is not None:
        raise EplbError(f"{n('model')} {model}: {why}: make them agree, or drop {n('model')} (the log then names no "
                        "model)")


def _group_of(experts: int, groups: int) -> NDArray[np.int64]:
    return np.repeat(np.arange(groups, dtype=np.int64), experts // groups)


def _log_ranks(rng: np.random.Generator, rows: int, experts: int) -> NDArray[np.float64]:
    """log(rank + 1) of every expert under an independent random ranking per row: [rows, experts]."""
    ranks = rng.permuted(np.tile(np.arange(1, experts + 1, dtype=np.float64), (rows, 1)), axis=1)
    out: NDArray[np.float64] = np.log(ranks)
    return out


def _calibration_draws(experts: int, groups: int) -> tuple[NDArray[np.float64], ...]:
    rng = np.random.default_rng(_CALIBRATION_SEED)
    n = _CALIBRATION_LAYERS
    log_rank = _log_ranks(rng, n, experts)
    group = rng.standard_normal((n, groups))[:, _group_of(experts, groups)]
    drift = rng.standard_normal((n, experts))
    return log_rank, group, drift


def _median_hot_ratio(a: float, draws: tuple[NDArray[np.float64], ...], group_std: float, drift_std: float) -> float:
    log_rank, group, drift = draws
    logp = -a * log_rank + group_std * group + drift_std * drift
    p = np.exp(logp - logp.max(axis=1, keepdims=True))
    return float(np.median(p.max(axis=1) / p.mean(axis=1)))


def exponent_for_hot_ratio(
    hot_ratio: float, experts: int, groups: int = 1, group_std: float = 0.0, drift_std: float = 0.0, top_k: int = 1
) -> float:
    """Power-law exponent a at which the median over layers of (hottest popularity / mean) is
    `hot_ratio`, with the given group and drift effects (Monte Carlo over 512 layers with a fixed
    seed, then bisection; deterministic). Raises EplbError when the noise alone already exceeds it, or when
    `hot_ratio` is above experts / top_k: a token picks top_k distinct experts, so no expert gets more than
    1/top_k of a layer's picks."""
    if hot_ratio * top_k > experts:
        raise EplbError(f"synth: a hot ratio of {hot_ratio:g} is out of reach for {plural(experts, 'expert')}, top-"
                        f"{top_k}: each token picks {top_k} distinct experts, so an expert gets at most 1/{top_k} of "
                        f"a layer's picks, experts / top-k = {experts / top_k:g}x the mean: lower --hot-ratio or give "
                        "--exponent")
    draws = _calibration_draws(experts, groups)
    low_ratio = _median_hot_ratio(0.0, draws, group_std, drift_std)
    if hot_ratio < low_ratio:
        raise EplbError(
            f"synth: a hot ratio of {hot_ratio:g} is below what the group and drift effects alone give "
            f"({low_ratio:.2f}); lower --group-std / --drift-std or raise --hot-ratio"
        )
    lo, hi = 0.0, 1.0
    while _median_hot_ratio(hi, draws, group_std, drift_std) < hot_ratio:
        hi *= 2
        if hi > 64:
            raise EplbError(f"synth: a hot ratio of {hot_ratio:g} is out of reach for {plural(experts, 'expert')} (the "
                            "hottest "
                            f"is at most {experts}x the mean): lower --hot-ratio or give --exponent")
    for _ in range(50):
        mid = (lo + hi) / 2
        if _median_hot_ratio(mid, draws, group_std, drift_std) < hot_ratio:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _coact_offsets(rng: np.random.Generator, layers: int, clusters: int, experts: int) -> NDArray[np.float64]:
    """u: [layers, clusters, experts] standard normal log-popularity offsets of the latent token types."""
    out: NDArray[np.float64] = rng.standard_normal((layers, clusters, experts))
    return out


def _topk_of(keys: NDArray[np.float64], k: int) -> NDArray[np.int64]:
    """Indices of the k largest keys along the last axis, largest first: [..., k]."""
    top = np.argpartition(-keys, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(keys, top, axis=-1), axis=-1)
    out: NDArray[np.int64] = np.take_along_axis(top, order, axis=-1)
    return out


def _calibration_lift(std: float, cfg: SynthConfig, a: float) -> float:
    from eplb.coactivation import partner_lift

    experts, top_k, clusters = cfg.experts, cfg.top_k, cfg.coact_clusters
    rng = np.random.default_rng(_CALIBRATION_SEED)
    layers, tokens = 4, min(8192, -(-_PICKS_PER_EXPERT * experts // top_k))
    group = rng.standard_normal((layers, cfg.groups))[:, _group_of(experts, cfg.groups)]
    logp = -a * _log_ranks(rng, layers, experts) + cfg.group_std * group
    logp += cfg.drift_std * rng.standard_normal((layers, experts))
    u = _coact_offsets(rng, layers, clusters, experts)
    z = rng.integers(0, clusters, tokens)
    p = np.exp(logp - logp.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    logits = _token_logits(_inclusions(p, top_k), std * u, top_k)
    keys = logits[None] + std * u[:, z, :].transpose(1, 0, 2) + rng.gumbel(size=(tokens, layers, experts))
    return partner_lift(_topk_of(keys, top_k), experts)


@functools.lru_cache(maxsize=32)
def coact_std_for_partner_lift(cfg: SynthConfig) -> float:
    """Co-activation strength at which `partner_lift` of cfg's token-level log is cfg.partner_lift
    (popularity with cfg's exponent, group and drift effects)
    (Monte Carlo over 4 layers with a fixed seed at the ESFT logs' sample density, 780 picks per expert,
    at most 8,192 tokens, since sampling noise alone raises the statistic; then bisection; deterministic).
    Independent picks already give slightly above 1 (sampling noise): a lower target gives 0; a target
    out of reach gives the largest strength tried, `COACT_STD_MAX` (the expected counts stay the counts format's, so
    hot experts, which every token type picks, weigh on the load-weighted lift: 128 experts top-8 at a hot ratio
    of 11 reach 2.11)."""
    lift, a = cfg.partner_lift, cfg.resolved_exponent()
    if _calibration_lift(0.0, cfg, a) >= lift:
        return 0.0
    lo, hi = 0.0, 1.0
    while _calibration_lift(hi, cfg, a) < lift:
        if hi >= COACT_STD_MAX:  # the lift levels off well before: the strongest we try
            return COACT_STD_MAX
        lo, hi = hi, min(2 * hi, COACT_STD_MAX)
    for _ in range(8):
        mid = (lo + hi) / 2
        if _calibration_lift(mid, cfg, a) < lift:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _inclusion(p: NDArray[np.float64], k: int) -> NDArray[np.float64]:
    """Inclusion probabilities pi [experts] of k distinct picks for popularity p [experts] (sums to 1):
    pi = min(1, c p) with c such that pi sums to k (water-filling; c = k when k p <= 1 everywhere)."""
    order = np.argsort(-p)
    ps = p[order]
    tail = np.cumsum(ps[::-1])[::-1]  # tail[m] = sum of ps[m:]
    m = np.arange(k)
    pi = np.zeros_like(p)
    if tail[k - 1] <= 0:  # fewer than k experts with a popularity above 0 (a steep one underflowed): in the
        pi[order[:k]] = 1.0  # limit the k hottest take every token
        return pi
    c = (k - m) / tail[:k]  # c when the m hottest are capped at 1
    capped = int(np.flatnonzero(c * ps[:k] <= 1)[0])  # the fewest capped that leave the next one below 1
    pi[order] = np.minimum(1.0, c[capped] * ps)
    pi[order[:capped]] = 1.0
    return pi


_POINTS_PER_DRAW = 1 << 20  # tokens x picks above which `_distinct_counts` draws per cell, not per token


def _distinct_counts(rng: np.random.Generator, pi: NDArray[np.float64], tokens: int) -> NDArray[np.int64]:
    """Counts [experts] of `tokens` tokens each picking round(sum pi) distinct experts, expert e with probability
    pi[e] <= 1: an expert at pi = 1 gets every token, the others by systematic sampling (points u, u + 1, ... on
    their cumulative pi, u uniform per token: an interval shorter than 1 holds at most one), so none gets more
    than `tokens`."""
    full = pi >= 1.0
    rest = np.flatnonzero(~full)
    k = round(float(pi[rest].sum()))
    out = np.where(full, tokens, 0).astype(np.int64)
    if k > 0:
        edges = np.cumsum(pi[rest])
        edges[-1] = k  # rounding: the last point u + k - 1 < k falls inside

        def picked(u: NDArray[np.float64]) -> NDArray[np.int64]:
            """The experts (indices into rest) [len(u), k] of tokens drawing u [len(u)] in [0, 1)."""
            return np.minimum(np.searchsorted(edges, u[:, None] + np.arange(k)[None, :], side="right"), rest.size - 1)

        if tokens * k <= _POINTS_PER_DRAW:
            out[rest] = np.bincount(picked(rng.random(tokens)).ravel(), minlength=rest.size)
        else:  # the same law without a draw per token: u's cells between the edges' fractional parts pick alike
            cuts = np.unique(np.concatenate([[0.0], np.mod(edges, 1.0), [1.0]]))
            tokens_per_cell = rng.multinomial(tokens, np.diff(cuts))  # cuts run from 0 to 1
            cells = picked((cuts[:-1] + cuts[1:]) / 2)
            out[rest] = np.bincount(cells.ravel(), weights=np.repeat(tokens_per_cell, k), minlength=rest.size)
    return out


def _inclusions(p: NDArray[np.float64], k: int) -> NDArray[np.float64]:
    """`_inclusion` of every row of p [layers, experts]: the expected picks per token of each expert, k p where
    k p <= 1 everywhere (the multinomial's), else the inclusion probabilities k distinct picks allow."""
    out = k * p
    for layer in np.flatnonzero(out.max(axis=1) > 1):
        out[layer] = _inclusion(p[layer], k)
    return out


def _concave_root(
    w: NDArray[np.float64], goal: NDArray[np.float64], axis: int, mean: bool, x: NDArray[np.float64]
) -> NDArray[np.float64]:
    """x >= 0 with f(x) = sum (or mean) along `axis` of 1 - exp(-w x) = goal, from the start x (same shape as
    goal): f is concave and increasing, so Newton's steps stay below the root after the first and converge to
    it."""
    n = w.shape[axis] if mean else 1
    for _ in range(100):
        e = np.exp(-w * x)
        f = (-np.expm1(-w * x)).sum(axis=axis, keepdims=True) / n - goal
        if not np.abs(f).max(initial=0.0) > 1e-12:
            break
        x = np.maximum(x - f / np.maximum((w * e).sum(axis=axis, keepdims=True) / n, 1e-300), 0.0)
    return x


def _token_logits(
    target: NDArray[np.float64], offsets: NDArray[np.float64], k: int, start: NDArray[np.float64] | None = None
) -> NDArray[np.float64]:
    """Logits lam [layers, experts] at which tokens of C equally likely types, a token of type z picking k distinct
    experts by Gumbel top-k of lam + offsets[:, z] ([layers, C, experts]), pick expert e target[l, e] times per token
    on average over the types: target sums to k per layer, in [0, 1], 1 = every token (logit 1e6).

    The inclusion probabilities of a Gumbel top-k draw are taken as Rosen's: 1 - exp(-w tau) for weights w = e^lam,
    tau such that they sum to k (within about 1% of the exact ones at 32 experts or more, a few % at 8). The
    unknowns are the logits and each type's s = log tau: given s, each expert's logit is a root of its own
    (`_concave_root`, mean over the types = target), which leaves the C equations "type z picks k" per layer;
    Newton's method on s solves them (C x C systems, the logits following s), and a layer where a Newton step
    does not halve the error takes the plain step instead, each type's tau given the logits (block coordinate
    descent of a convex function, which converges whatever the offsets). start: the logits to begin from (the
    previous step's: a few steps then)."""
    clusters = offsets.shape[1]
    always = target >= 1.0
    free = ~always
    kk = (k - always.sum(axis=1)).astype(np.float64)[:, None, None]  # picks left to the others, per layer
    live = kk[:, 0, 0] > 0
    goal = np.where(free, np.clip(target, 1e-300, 1 - 1e-16), 0.0)[:, None, :]
    lam = np.log(-np.log1p(-np.where(free, goal[:, 0], 0.5)))  # exact without offsets (one type)
    if start is not None:
        lam = np.where(start < 1e5, start, lam)  # an expert every token took: from the exact start
    lam = np.where(free, np.maximum(lam, -1e4), -1e4)  # the others weigh nothing (finite: no inf - inf)

    def types_step(lam: NDArray[np.float64], s: NDArray[np.float64] | None) -> NDArray[np.float64]:
        """Each type's s given the logits: its picks sum to the k left."""
        x = lam[:, None, :] + offsets
        top = x.max(axis=2, keepdims=True)
        start = np.zeros_like(top) if s is None else np.exp(np.minimum(s + top, 700.0))
        tau = _concave_root(np.exp(x - top), kk, 2, False, start)
        out: NDArray[np.float64] = np.log(np.maximum(tau, 1e-300)) - top
        return out

    def experts_step(s: NDArray[np.float64], lam: NDArray[np.float64]) -> NDArray[np.float64]:
        """Each expert's logit given the types' s: its picks, averaged over the types, are its target."""
        y = offsets + s
        top = y.max(axis=1, keepdims=True)
        mu = _concave_root(np.exp(y - top), goal, 1, True, np.exp(np.minimum(lam[:, None, :] + top, 700.0)))
        out: NDArray[np.float64] = np.where(free, np.maximum(np.log(np.maximum(mu[:, 0], 1e-300)) - top[:, 0], -1e4),
                                            -1e4)  # fmt: skip
        return out

    def errors(lam: NDArray[np.float64], s: NDArray[np.float64]) -> tuple[NDArray[np.float64], ...]:
        """Each type's picks over k [layers, C], each layer's largest |error| and the weights w tau."""
        wt = np.exp(np.minimum(lam[:, None, :] + offsets + s, 700.0))
        err = np.where(live[:, None], (-np.expm1(-wt)).sum(axis=2) - kk[:, :, 0], 0.0)
        return err, np.abs(err).max(axis=1), wt

    s = types_step(lam, None)
    lam = experts_step(s, lam)
    err, worst, wt = errors(lam, s)
    diagonal = np.arange(clusters)
    for _ in range(500):
        if not worst.max() > 1e-9:
            break
        # d err_z / d s_z' with the logits following s: diag(d) - C B^T diag(1 / a) B, B = h / C, a = mean_z h
        h = wt * np.exp(-wt) * free[:, None, :]
        a = np.maximum(h.mean(axis=1), 1e-300)
        d = h.sum(axis=2)
        ha = h / np.sqrt(a)[:, None, :]
        jac = -np.einsum("lce,lde->lcd", ha, ha) / clusters
        jac[:, diagonal, diagonal] += d + 1e-12 * d.max(axis=1, keepdims=True) + 1e-300
        jac += (d.mean(axis=1) / clusters)[:, None, None]  # s + c, lam - c change nothing: pin that direction
        new_s = s - np.linalg.solve(jac, err[..., None])
        new_lam = experts_step(new_s, lam)
        new_err, new_worst, new_wt = errors(new_lam, new_s)
        slow = new_worst > 0.5 * worst
        if slow.any():  # the plain step there
            plain_s = types_step(lam, s)
            plain_lam = experts_step(plain_s, lam)
            plain_err, plain_worst, plain_wt = errors(plain_lam, plain_s)
            new_s[slow], new_lam[slow], new_err[slow] = plain_s[slow], plain_lam[slow], plain_err[slow]
            new_worst[slow], new_wt[slow] = plain_worst[slow], plain_wt[slow]
        s, lam, err, worst, wt = new_s, new_lam, new_err, new_worst, new_wt
    out: NDArray[np.float64] = np.where(always, 1e6, lam)
    return out


class _Popularity:
    """The popularity process of SynthConfig, one step at a time ([layers, experts] probabilities)."""

    def __init__(self, cfg: SynthConfig) -> None:
        cfg.check()
        self.cfg = cfg
        self.a = cfg.resolved_exponent()
        init, drift, shift_time, shift_draw, sample, _, cap = np.random.SeedSequence(cfg.seed).spawn(7)
        self.rng_cap = np.random.default_rng(cap)  # the k-distinct redraws (`sample`); the 6th is synth_topk's
        self.rng_drift = np.random.default_rng(drift)
        self.rng_shift_time = np.random.default_rng(shift_time)
        self.rng_shift = np.random.default_rng(shift_draw)
        self.rng_sample = np.random.default_rng(sample)
        rng_init = np.random.default_rng(init)
        self.group_of = _group_of(cfg.experts, cfg.groups)
        self.base = self._regime(rng_init)
        self.x = rng_init.standard_normal((cfg.layers, cfg.experts))
        self.rho = math.exp(-1.0 / cfg.drift_steps)
        self.shifts = set(cfg.shift_at)
        self.next_random_shift = self._next_shift(0)
        self.step = 0

    def _regime(self, rng: np.random.Generator) -> NDArray[np.float64]:
        """Per-layer log popularity without drift: power law over a random ranking plus group factors."""
        cfg = self.cfg
        log_rank = _log_ranks(rng, cfg.layers, cfg.experts)
        group = rng.standard_normal((cfg.layers, cfg.groups))[:, self.group_of]
        out: NDArray[np.float64] = -self.a * log_rank + cfg.group_std * group
        return out

    def sample(self, p: NDArray[np.float64]) -> NDArray[np.int64]:
        """One step's counts [layers, experts] for popularity p [layers, experts]: a multinomial of tokens x top_k
        picks per layer, except a layer where k distinct picks per token bind (an expert with top_k x p > 1, or a
        multinomial draw giving an expert more picks than tokens): it is drawn again by the inclusion
        probabilities k distinct picks allow (`_inclusion`, `_distinct_counts`), so no expert exceeds tokens. The
        multinomial is drawn for every layer first, so the layers where nothing binds are the multinomial's."""
        cfg = self.cfg
        out: NDArray[np.int64] = self.rng_sample.multinomial(cfg.tokens * cfg.top_k, p)
        binds = (cfg.top_k * p.max(axis=1) > 1) | (out.max(axis=1) > cfg.tokens)
        for layer in np.flatnonzero(binds):
            out[layer] = _distinct_counts(self.rng_cap, _inclusion(p[layer], cfg.top_k), cfg.tokens)
        return out

    def _next_shift(self, after: int) -> int | None:
        if self.cfg.shift_every <= 0:
            return None
        return after + max(1, round(float(self.rng_shift_time.exponential(self.cfg.shift_every))))

    def next(self) -> NDArray[np.float64]:
        """Popularity of the next step: [layers, experts], rows sum to 1."""
        t = self.step
        if t > 0:
            self.x = self.rho * self.x + math.sqrt(1 - self.rho**2) * self.rng_drift.standard_normal(self.x.shape)
        if t in self.shifts or t == self.next_random_shift:
            self.base = self._regime(self.rng_shift)
            if t == self.next_random_shift:
                self.next_random_shift = self._next_shift(t)
        logp = self.base + self.cfg.drift_std * self.x
        p = np.exp(logp - logp.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        self.step += 1
        out: NDArray[np.float64] = p
        return out


def synth_counts(cfg: SynthConfig, chunk_steps: int = 256) -> Iterator[NDArray[Any]]:
    """The log of `cfg`, streamed: chunks of [n, layers, experts] counts (dtype cfg.count_dtype);
    every layer of every step sums to tokens x top_k."""
    proc = _Popularity(cfg)
    dtype = cfg.count_dtype
    for start in range(0, cfg.steps, chunk_steps):
        n = min(chunk_steps, cfg.steps - start)
        out = np.empty((n, cfg.layers, cfg.experts), dtype=dtype)
        for i in range(n):
            out[i] = proc.sample(proc.next())
        yield out


def synth_log(cfg: SynthConfig) -> NDArray[Any]:
    """The whole log of `cfg` in memory: [steps, layers, experts]."""
    return np.concatenate(list(synth_counts(cfg)), axis=0)


def synth_topk(
    cfg: SynthConfig, progress: Callable[[int], None] | None = None
) -> tuple[NDArray[np.int16], NDArray[np.int64]]:
    """Token-level routing for `cfg`: (topk_ids [steps x tokens, layers, top_k] int16, step_offsets
    [steps + 1]). Each token picks top_k distinct experts per layer by Gumbel top-k, ordered hottest draw first,
    of per-step logits solved (`_token_logits`) so that each expert's expected picks are the counts format's,
    tokens x top_k x p, or tokens x the inclusion probabilities where k distinct picks bind (`_inclusions`): the
    same popularity gives the same expected counts, and the same hot ratio, in both formats. With co-activation
    (SynthConfig) each token's logits are shifted by its latent type's offsets, and the logits are solved for the
    average over the types. Costs tokens x layers x experts random numbers per step: meant for small captures.
    progress: called with the steps drawn after each step (`eplb.progress.Progress`)."""
    if cfg.experts > np.iinfo(np.int16).max + 1:
        raise EplbError(f"synth: {cfg.experts} experts do not fit int16 expert ids")
    proc = _Popularity(cfg)
    k = cfg.top_k
    std = cfg.resolved_coact_std()
    rng_coact = np.random.default_rng(np.random.SeedSequence(cfg.seed).spawn(6)[5])
    type_shift = _coact_offsets(rng_coact, cfg.layers, max(cfg.coact_clusters, 1), cfg.experts) * std
    out = np.empty((cfg.steps * cfg.tokens, cfg.layers, k), dtype=np.int16)
    logits: NDArray[np.float64] | None = None
    for s in range(cfg.steps):
        logits = _token_logits(_inclusions(proc.next(), k), type_shift, k, logits)
        keys = logits[None, :, :] + proc.rng_sample.gumbel(size=(cfg.tokens, cfg.layers, cfg.experts))
        if std > 0:
            keys += type_shift[:, rng_coact.integers(0, cfg.coact_clusters, cfg.tokens), :].transpose(1, 0, 2)
        out[s * cfg.tokens : (s + 1) * cfg.tokens] = _topk_of(keys, k)
        if progress is not None:
            progress(s + 1)
    offsets = np.arange(cfg.steps + 1, dtype=np.int64) * cfg.tokens
    return out, offsets


def seed004_log(
    steps: int = 1, layers: int = 1, seed: int = 0, progress: Callable[[int], None] | None = None
) -> NDArray[np.int64]:
    """Seed 004 section 5.2 counts as a log [steps, layers, 256]: step s, layer l is
    `seed004_counts(seed=seed + s * layers + l)`, so steps=layers=1, seed=0 is the published draw. progress:
    called with the steps drawn after each step."""
    out = np.empty((steps, layers, 256), dtype=np.int64)
    for s in range(steps):
        for layer in range(layers):
            out[s, layer] = seed004_counts(seed=seed + s * layers + layer)
        if progress is not None:
            progress(s + 1)
    return out


# --------------------------------------------------------------------------------------------
# Statistics users compare against published numbers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogStats:
    """Per layer-step statistics of a counts log, as medians (p10, p90) over layer-steps.

    hot_ratio: hottest expert / mean expert; no_eplb_lb: max / mean GPU load with experts in id
    order on `gpus` GPUs, no redundancy (imbalance = lb - 1, TensorRT-LLM's number);
    hot_set_overlap: {lag: mean fraction of a layer's `top` hottest experts still among its
    `top` hottest `lag` steps later}."""

    steps: int
    gpus: int
    hot_ratio: tuple[float, float, float]
    no_eplb_lb: tuple[float, float, float]
    hot_set_overlap: dict[int, float]
    top: int

    @property
    def imbalance(self) -> float:
        """Median (max - mean) / mean GPU load without EPLB."""
        return self.no_eplb_lb[0] - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "gpus": self.gpus,
            "hot_ratio": {"median": self.hot_ratio[0], "p10": self.hot_ratio[1], "p90": self.hot_ratio[2]},
            "no_eplb_lb": {"median": self.no_eplb_lb[0], "p10": self.no_eplb_lb[1], "p90": self.no_eplb_lb[2]},
            "no_eplb_imbalance_median": self.imbalance,
            "hot_set_overlap": {str(k): v for k, v in self.hot_set_overlap.items()},
            "hot_set_size": self.top,
        }


class StatsAccumulator:
    """`log_stats` fed one chunk at a time (memory: the hot sets of the last max(lags) steps)."""

    def __init__(self, gpus: int = 32, top: int | None = None, lags: tuple[int, ...] = (1, 10, 100, 1000)) -> None:
        self.gpus, self.top, self.lags = gpus, top, lags
        self.hot: list[NDArray[np.float64]] = []
        self.lbs: list[NDArray[np.float64]] = []
        self.history: list[NDArray[np.bool_]] = []  # [layers, E] hot-set masks of recent steps
        self.overlap_sum = dict.fromkeys(lags, 0.0)
        self.overlap_n = dict.fromkeys(lags, 0)
        self.steps = 0
        self.k = top or 16

    def add(self, chunk: NDArray[Any]) -> None:
        """chunk: [n, layers, E] counts of the next n steps."""
        c = np.asarray(chunk, dtype=np.float64)
        n, _, experts = c.shape
        mean = c.mean(axis=2)
        ok = mean > 0
        self.hot.append((c.max(axis=2)[ok] / mean[ok]).ravel())
        self.gpus = min(self.gpus, experts)  # no-EPLB needs an expert per GPU
        bounds = np.concatenate([[0], np.cumsum(spread_evenly(experts, self.gpus))[:-1]])
        per_gpu = np.add.reduceat(c, bounds, axis=2)
        self.lbs.append((per_gpu.max(axis=2)[ok] / per_gpu.mean(axis=2)[ok]).ravel())
        self.k = k = max(1, min(16, experts // 16)) if self.top is None else min(self.top, experts)
        idx = np.argpartition(-c, k - 1, axis=2)[:, :, :k]
        masks = np.zeros(c.shape, dtype=bool)
        np.put_along_axis(masks, idx, True, axis=2)
        max_lag = max(self.lags)
        for i in range(n):
            self.history.append(masks[i])
            for lag in self.lags:
                if len(self.history) > lag:
                    same = (self.history[-1] & self.history[-1 - lag]).sum(axis=1) / k
                    self.overlap_sum[lag] += float(same.mean())
                    self.overlap_n[lag] += 1
            if len(self.history) > max_lag + 1:
                self.history.pop(0)
        self.steps += n

    def result(self) -> LogStats:
        h = np.concatenate(self.hot) if self.hot else np.ones(1)
        lb = np.concatenate(self.lbs) if self.lbs else np.ones(1)

        def med(a: NDArray[np.float64]) -> tuple[float, float, float]:
            return float(np.median(a)), float(np.percentile(a, 10)), float(np.percentile(a, 90))

        overlap = {lag: self.overlap_sum[lag] / self.overlap_n[lag] for lag in self.lags if self.overlap_n[lag]}
        return LogStats(self.steps, self.gpus, med(h), med(lb), overlap, self.k)


def log_stats(
    chunks: Iterable[NDArray[Any]], gpus: int = 32, top: int | None = None, lags: tuple[int, ...] = (1, 10, 100, 1000)
) -> LogStats:
    """Statistics of a counts log streamed as [n, layers, E] chunks (see LogStats). top: hot-set size
    (default E / 16, at most 16: 16 of DeepSeek's 256)."""
    acc = StatsAccumulator(gpus, top, lags)
    for chunk in chunks:
        acc.add(chunk)
    return acc.result()
