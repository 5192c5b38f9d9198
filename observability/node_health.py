"""Sluggish-node detection and the forward-progress watchdog: pure logic, fed samples, asked to judge.

Per node a sliding window of inter-token latency (ITL) samples, each with the batch size it was
produced at, and of TTFT samples with their prompt length. Every `evaluate(now)`:

    per node:  ITL medians per batch-size bucket            (1, 2, 3-4, 5-8, 9-16, ...)
    expected:  the peers' consensus curve ITL(batch)         (median across peers per bucket, then a
                                                              weighted line a + s*batch through them)
    score:     node's median / expected, at the batches it ran (comparable load only)
    outlier:   score >= min_ratio and log(score) > median + k*MAD of all nodes' log scores
    flag:      outlier for `flag_after` consecutive evaluations; unflag after `unflag_after`
               consecutive evaluations with score < recover_ratio

A node slower only because it runs a bigger batch sits on the peers' curve and scores ~1. TTFT,
compared per prompt-length bucket, is the fallback signal when a node has too few ITL samples.
Separately, a node with requests in flight that produced no token for `stall_after_s` is stalled,
whatever its latency, until a token arrives.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeHealthConfig:
    window_s: float = 20.0
    """Samples older than this are forgotten."""
    min_samples: int = 20
    """ITL samples a node needs in the window to be judged on ITL."""
    min_bucket_samples: int = 3
    """Samples a batch-size (or prompt-length) bucket needs to count."""
    min_ratio: float = 1.5
    """Latency vs the peers' expectation at comparable load needed to count as slow."""
    ttft_min_ratio: float = 2.0
    """The same for TTFT (noisier: it includes queueing), used only without enough ITL samples."""
    min_ttft_samples: int = 5
    recover_ratio: float = 1.25
    """A flagged node whose score is below this counts as recovering."""
    mad_k: float = 3.0
    """How many (scaled) MADs above the median log score an outlier must be (3+ scored nodes)."""
    mad_floor: float = 0.05
    """Lower bound of the scaled MAD (log space), so identical peers do not make noise an outlier."""
    flag_after: int = 3
    """Consecutive slow evaluations before a node is flagged: one spike never flags."""
    unflag_after: int = 3
    """Consecutive recovered evaluations before the flag is lifted."""
    stall_after_s: float = 10.0
    """A node with requests in flight and no token for this long is stalled."""
    eval_interval_s: float = 1.0
    """How often the driver calls evaluate()."""


class NodeStatus(enum.StrEnum):
    HEALTHY = "healthy"
    SLUGGISH = "sluggish"
    STALLED = "stalled"
    DEAD = "dead"


class EventKind(enum.StrEnum):
    FLAGGED = "flagged"
    UNFLAGGED = "unflagged"
    STALLED = "stalled"
    RECOVERED = "recovered"
    RESTARTED = "restarted"  # a dead node's engine came back (a fresh process: a fresh window)


@dataclass(frozen=True)
class NodeEvent:
    time: float
    node: str
    kind: EventKind
    reason: str


@dataclass(frozen=True)
class NodeAssessment:
    """One node's window figures and verdict."""

    node: str
    status: NodeStatus
    reason: str | None
    since: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    ttft_p50_s: float | None
    score: float | None  # latency / peers' expectation at comparable load; None: not enough data
    samples: int


PROMPT_BUCKETS = (128, 512, 2048, 8192)


def prompt_bucket(prompt_tokens: int) -> str:
    """Label of a prompt length: "<=128", "<=512", "<=2k", "<=8k", ">8k"."""
    for edge in PROMPT_BUCKETS:
        if prompt_tokens <= edge:
            return f"<={edge // 1024}k" if edge >= 1024 else f"<={edge}"
    return ">8k"


def _batch_bucket(batch: int) -> int:
    return max(0, math.ceil(math.log2(max(1, batch))))


@dataclass
class _Node:
    itl: deque[tuple[float, float, int]] = field(default_factory=deque)  # (time, itl_s, batch)
    ttft: deque[tuple[float, float, int]] = field(default_factory=deque)  # (time, ttft_s, prompt)
    status: NodeStatus = NodeStatus.HEALTHY
    since: float | None = None
    reason: str | None = None
    strikes: int = 0
    clears: int = 0
    in_flight: int = 0
    last_progress: float = 0.0
    score: float | None = None


class NodeHealthMonitor:
    def __init__(self, nodes: Iterable[str], config: NodeHealthConfig | None = None) -> None:
        self.config = config or NodeHealthConfig()
        self._nodes: dict[str, _Node] = {n: _Node() for n in nodes}
        self.events: deque[NodeEvent] = deque(maxlen=500)  # the latest transitions, oldest first
        self._pending: list[NodeEvent] = []

    def add_node(self, node: str, now: float) -> None:
        """A node that joined later (a fleet worker); a known one is left as it is."""
        if node not in self._nodes:
            self._nodes[node] = _Node(last_progress=now)

    # ----- samples --------------------------------------------------------------------

    def record_itl(self, node: str, t: float, itl_s: float, batch: int) -> None:
        n = self._nodes[node]
        n.itl.append((t, itl_s, batch))
        n.last_progress = max(n.last_progress, t)

    def record_ttft(self, node: str, t: float, ttft_s: float, prompt_tokens: int) -> None:
        n = self._nodes[node]
        n.ttft.append((t, ttft_s, prompt_tokens))
        n.last_progress = max(n.last_progress, t)

    def record_progress(self, node: str, t: float) -> None:
        """The node produced output at `t` (any request): the watchdog's evidence of life."""
        n = self._nodes[node]
        n.last_progress = max(n.last_progress, t)

    def set_in_flight(self, node: str, in_flight: int, now: float) -> None:
        """Requests the node holds now; the watchdog's clock starts when work arrives at an idle node."""
        n = self._nodes[node]
        if n.in_flight == 0 and in_flight > 0:
            n.last_progress = max(n.last_progress, now)
        n.in_flight = in_flight

    def mark_dead(self, node: str, reason: str, now: float) -> None:
        """The node's engine is gone; a node already dead only has its reason updated (no new event)."""
        n = self._nodes[node]
        if n.status is not NodeStatus.DEAD:
            self._transition(n, node, NodeStatus.DEAD, EventKind.FLAGGED, reason, now)
        else:
            n.reason = reason

    def mark_restarted(self, node: str, now: float) -> None:
        """A dead node runs again: a new process, judged afresh (its old samples say nothing of it)."""
        old = self._nodes[node]
        fresh = self._nodes[node] = _Node(last_progress=now)
        if old.status is NodeStatus.DEAD:
            self._transition(fresh, node, NodeStatus.HEALTHY, EventKind.RESTARTED, "engine restarted", now)

    def status(self, node: str) -> NodeStatus:
        return self._nodes[node].status

    # ----- judging --------------------------------------------------------------------

    def evaluate(self, now: float) -> list[NodeEvent]:
        """Advance every node's verdict by one evaluation; returns the transitions it caused."""
        cfg = self.config
        for n in self._nodes.values():
            _trim(n.itl, now - cfg.window_s)
            _trim(n.ttft, now - cfg.window_s)
        itl_scores = self._itl_scores()
        ttft_scores = self._ttft_scores()
        itl_slow = self._outliers(itl_scores, cfg.min_ratio)
        ttft_slow = self._outliers(ttft_scores, cfg.ttft_min_ratio)
        for name, n in self._nodes.items():
            if n.status is NodeStatus.DEAD:
                continue
            n.score = itl_scores.get(name, ttft_scores.get(name))
            silent = now - n.last_progress
            if n.in_flight > 0 and silent >= cfg.stall_after_s:
                if n.status is not NodeStatus.STALLED:
                    reason = f"{n.in_flight} requests in flight, no token for {silent:.1f} s"
                    self._transition(n, name, NodeStatus.STALLED, EventKind.STALLED, reason, now)
                continue
            if n.status is NodeStatus.STALLED:
                self._transition(n, name, NodeStatus.HEALTHY, EventKind.RECOVERED, "tokens flowing again", now)
                continue
            if name in itl_scores:
                slow, kind, score = name in itl_slow, "itl", itl_scores[name]
            elif name in ttft_scores:
                slow, kind, score = name in ttft_slow, "ttft", ttft_scores[name]
            else:
                continue  # no evidence either way: keep the verdict
            if n.status is NodeStatus.HEALTHY:
                n.strikes = n.strikes + 1 if slow else 0
                if n.strikes >= cfg.flag_after:
                    reason = (f"{kind} {score:.1f}x peers at comparable load "
                              f"for {n.strikes} evaluations")
                    self._transition(n, name, NodeStatus.SLUGGISH, EventKind.FLAGGED, reason, now)
            elif n.status is NodeStatus.SLUGGISH:
                n.clears = n.clears + 1 if score < cfg.recover_ratio else 0
                if n.clears >= cfg.unflag_after:
                    reason = f"{kind} back to {score:.2f}x peers for {n.clears} evaluations"
                    self._transition(n, name, NodeStatus.HEALTHY, EventKind.UNFLAGGED, reason, now)
        pending, self._pending = self._pending, []
        return pending

    def assessments(self) -> list[NodeAssessment]:
        out = []
        for name, n in self._nodes.items():
            itls = sorted(s[1] for s in n.itl)
            ttfts = sorted(s[1] for s in n.ttft)
            out.append(NodeAssessment(
                node=name,
                status=n.status,
                reason=n.reason if n.status is not NodeStatus.HEALTHY else None,
                since=n.since,
                itl_p50_s=_quantile(itls, 0.5),
                itl_p99_s=_quantile(itls, 0.99),
                ttft_p50_s=_quantile(ttfts, 0.5),
                score=n.score,
                samples=len(itls),
            ))
        return out

    # ----- internals ------------------------------------------------------------------

    def _transition(
        self, n: _Node, name: str, status: NodeStatus, kind: EventKind, reason: str, now: float
    ) -> None:
        n.status, n.since, n.reason = status, now, reason
        n.strikes = n.clears = 0
        event = NodeEvent(now, name, kind, reason)
        self.events.append(event)
        self._pending.append(event)

    def _itl_scores(self) -> dict[str, float]:
        cfg = self.config
        judged = {name: n for name, n in self._nodes.items()
                  if n.status is not NodeStatus.DEAD and len(n.itl) >= cfg.min_samples}
        if len(judged) < 2:  # a node is scored against its peers: alone, its window's samples say nothing
            return {}
        # node -> bucket -> (median batch, median itl, count)
        points: dict[str, dict[int, tuple[float, float, int]]] = {}
        for name, n in judged.items():
            groups: dict[int, list[tuple[float, int]]] = {}
            for _, itl, batch in n.itl:
                groups.setdefault(_batch_bucket(batch), []).append((itl, batch))
            # Geometric means, not medians: a node turning slow moves its score at once (in proportion
            # to the share of slow samples) instead of only after half the window has turned.
            points[name] = {
                b: (statistics.median(x[1] for x in g), _geomean(x[0] for x in g), len(g))
                for b, g in groups.items() if len(g) >= cfg.min_bucket_samples
            }
        scores = {}
        for name, mine in points.items():
            peers = [p for other, p in points.items() if other != name]
            curve = _peer_curve(peers)
            if curve is None or not mine:
                continue
            lo, hi, expected = curve
            ratios = [(itl / expected(batch), count) for batch, itl, count in mine.values()
                      if lo / 2 <= batch <= hi * 2]  # comparable load only: no wild extrapolation
            if ratios:
                scores[name] = _weighted_geomean(ratios)
        return scores

    def _ttft_scores(self) -> dict[str, float]:
        cfg = self.config
        judged = {name: n for name, n in self._nodes.items()
                  if n.status is not NodeStatus.DEAD and len(n.ttft) >= cfg.min_ttft_samples}
        if len(judged) < 2:  # as for the ITL: no peers, no score
            return {}
        medians: dict[str, dict[str, tuple[float, int]]] = {}
        for name, n in judged.items():
            groups: dict[str, list[float]] = {}
            for _, ttft, prompt in n.ttft:
                groups.setdefault(prompt_bucket(prompt), []).append(ttft)
            medians[name] = {b: (statistics.median(g), len(g)) for b, g in groups.items()
                             if len(g) >= cfg.min_bucket_samples}
        scores = {}
        for name, mine in medians.items():
            ratios = []
            for bucket, (value, count) in mine.items():
                peer_values = [m[bucket][0] for other, m in medians.items() if other != name and bucket in m]
                if peer_values:
                    ratios.append((value / max(statistics.median(peer_values), 1e-6), count))
            if ratios:
                scores[name] = _weighted_geomean(ratios)
        return scores

    def _outliers(self, scores: dict[str, float], min_ratio: float) -> set[str]:
        slow = {n for n, s in scores.items() if s >= min_ratio}
        if len(scores) < 3:  # with two nodes a MAD says nothing; the ratio to the peer decides
            return slow
        logs = {n: math.log(max(s, 1e-9)) for n, s in scores.items()}
        med = statistics.median(logs.values())
        mad = max(1.4826 * statistics.median(abs(v - med) for v in logs.values()), self.config.mad_floor)
        return {n for n in slow if logs[n] > med + self.config.mad_k * mad}


def _peer_curve(
    peers: list[dict[int, tuple[float, float, int]]],
) -> tuple[float, float, _Line] | None:
    """The peers' consensus ITL(batch): per bucket the median across peers, then a weighted line."""
    by_bucket: dict[int, list[tuple[float, float, int]]] = {}
    for p in peers:
        for b, point in p.items():
            by_bucket.setdefault(b, []).append(point)
    if not by_bucket:
        return None
    consensus = [
        (statistics.median(x[0] for x in pts), statistics.median(x[1] for x in pts), sum(x[2] for x in pts))
        for pts in by_bucket.values()
    ]
    batches = [c[0] for c in consensus]
    return min(batches), max(batches), _Line.fit(consensus)


@dataclass(frozen=True)
class _Line:
    intercept: float
    slope: float
    floor: float

    @classmethod
    def fit(cls, points: list[tuple[float, float, int]]) -> _Line:
        """Weighted least squares itl = a + s*batch, s >= 0; flat when all points share one batch."""
        w = sum(p[2] for p in points)
        mx = sum(p[0] * p[2] for p in points) / w
        my = sum(p[1] * p[2] for p in points) / w
        sxx = sum(p[2] * (p[0] - mx) ** 2 for p in points)
        slope = max(0.0, sum(p[2] * (p[0] - mx) * (p[1] - my) for p in points) / sxx) if sxx > 0 else 0.0
        return cls(my - slope * mx, slope, 0.25 * min(p[1] for p in points))

    def __call__(self, batch: float) -> float:
        return max(self.intercept + self.slope * batch, self.floor, 1e-6)


def _geomean(values: Iterable[float]) -> float:
    logs = [math.log(max(v, 1e-9)) for v in values]
    return math.exp(sum(logs) / len(logs))


def _weighted_geomean(ratios: list[tuple[float, int]]) -> float:
    total = sum(c for _, c in ratios)
    return math.exp(sum(math.log(max(r, 1e-9)) * c for r, c in ratios) / total)


def _trim(samples: deque[tuple[float, float, int]], oldest: float) -> None:
    while samples and samples[0][0] < oldest:
        samples.popleft()


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
