"""What a run comes to: per tier TTFT SLO attainment, requests shed, worker-hours; and the PNG plots.

Attainment counts every request that arrived: one shed, or never served, missed its target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simulator.fleet import Result, ShedReason
from simulator.traffic import HOUR

TIER_NAMES = ("premium", "standard", "batch")


@dataclass(frozen=True)
class TierSummary:
    tier: int
    requests: int
    attainment: float  # share of requests with TTFT <= target (shed ones count as misses)
    shed: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None


@dataclass(frozen=True)
class Summary:
    policy: str
    requests: int
    worker_hours: float
    peak_workers: int
    shed: int
    tiers: list[TierSummary]

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy, "requests": self.requests, "worker_hours": round(self.worker_hours, 2),
            "peak_workers": self.peak_workers, "shed": self.shed,
            "tiers": [{**t.__dict__, "name": tier_name(t.tier)} for t in self.tiers],
        }


def tier_name(tier: int) -> str:
    return TIER_NAMES[tier] if tier < len(TIER_NAMES) else f"tier-{tier}"


def summarize(result: Result, targets: tuple[float, ...]) -> Summary:
    tiers = []
    for tier in range(len(targets)):
        mask = result.arrivals.tier == tier
        ttft = result.ttft[mask]
        served = ttft[~np.isnan(ttft)]
        met = np.count_nonzero(served <= targets[tier])
        tiers.append(TierSummary(
            tier=tier, requests=int(mask.sum()), attainment=met / max(1, int(mask.sum())),
            shed=int(np.count_nonzero(result.shed[mask] != ShedReason.NONE)),
            ttft_p50_s=float(np.percentile(served, 50)) if len(served) else None,
            ttft_p99_s=float(np.percentile(served, 99)) if len(served) else None,
        ))
    return Summary(result.policy, len(result.arrivals), result.worker_seconds / HOUR,
                   max(result.series.workers, default=0), sum(t.shed for t in tiers), tiers)


def hourly_attainment(result: Result, tier: int, target: float) -> np.ndarray:
    """Per hour of arrival: share of the tier's requests with TTFT <= target (nan: none arrived)."""
    hours = (result.arrivals.time // HOUR).astype(np.int64)
    mask = result.arrivals.tier == tier
    met = mask & (np.nan_to_num(result.ttft, nan=np.inf) <= target)
    n = int(hours.max()) + 1 if len(hours) else 0
    total = np.bincount(hours[mask], minlength=n).astype(float)
    good = np.bincount(hours[met], minlength=n).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, good / total, np.nan)


def table(summaries: list[Summary], targets: tuple[float, ...]) -> str:
    head = ["policy", "worker-h", "peak"] + [f"{tier_name(t)} <= {targets[t]:g}s" for t in range(len(targets))]
    head += ["shed"]
    rows = [head]
    for s in summaries:
        rows.append([s.policy, f"{s.worker_hours:.1f}", str(s.peak_workers)]
                    + [f"{t.attainment * 100:.2f}%" for t in s.tiers] + [str(s.shed)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def plot(results: list[Result], targets: tuple[float, ...], out: Path) -> list[Path]:
    """fleet.png (arrival rate and workers over the day), attainment.png (hourly TTFT SLO attainment
    per tier), summary.png (worker-hours and attainment per policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    arrivals = results[0].arrivals
    fig, (ax_rate, ax_workers) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    bins = np.arange(0, arrivals.time.max() + 300, 300)
    counts, _ = np.histogram(arrivals.time, bins)
    ax_rate.plot(bins[:-1] / HOUR, counts / 300, color="black", lw=1)
    ax_rate.set_ylabel("arrivals / s (5 min)")
    ax_rate.set_title("A day of traffic and the fleet each policy runs")
    for r in results:
        ax_workers.step(np.asarray(r.series.time) / HOUR, r.series.workers, where="post", label=r.policy)
    ax_workers.set_ylabel("workers (booting + serving)")
    ax_workers.set_xlabel("hour of day")
    ax_workers.legend()
    ax_workers.set_xlim(0, 24)
    fig.tight_layout()
    paths.append(out / "fleet.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(targets), 1, figsize=(11, 2.6 * len(targets)), sharex=True)
    for tier, ax in enumerate(np.atleast_1d(axes)):
        for r in results:
            ax.plot(np.arange(len(hourly_attainment(r, tier, targets[tier]))) + 0.5,
                    hourly_attainment(r, tier, targets[tier]) * 100, marker="o", ms=3, label=r.policy)
        ax.set_ylabel(f"{tier_name(tier)}\n% TTFT <= {targets[tier]:g} s")
        ax.set_ylim(max(0, ax.get_ylim()[0]), 100.5)
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].legend()
    np.atleast_1d(axes)[0].set_title("TTFT SLO attainment by hour of arrival (shed requests count as misses)")
    np.atleast_1d(axes)[-1].set_xlabel("hour of day")
    np.atleast_1d(axes)[-1].set_xlim(0, 24)
    fig.tight_layout()
    paths.append(out / "attainment.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    summaries = [summarize(r, targets) for r in results]
    fig, (ax_cost, ax_slo) = plt.subplots(1, 2, figsize=(11, 4))
    names = [s.policy for s in summaries]
    ax_cost.bar(names, [s.worker_hours for s in summaries], color="tab:gray")
    ax_cost.set_ylabel("worker-hours per day")
    width = 0.8 / len(targets)
    for tier in range(len(targets)):
        x = np.arange(len(summaries)) + (tier - (len(targets) - 1) / 2) * width
        ax_slo.bar(x, [100 * (1 - s.tiers[tier].attainment) for s in summaries], width, label=tier_name(tier))
    ax_slo.set_xticks(np.arange(len(summaries)), names)
    ax_slo.set_ylabel("% requests missing their TTFT target")
    ax_slo.legend()
    fig.tight_layout()
    paths.append(out / "summary.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
