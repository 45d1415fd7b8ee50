"""Replay results: capacity parsing, the report object, a text table and JSON."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.units import parse_tokens

from .replayer import ReplayStats

OPTIMAL = "belady"
BASELINE = "lru"     # the policy the "gap closed" column measures from


def parse_capacity(text: str) -> int | None:
    """A token count as `radixserve.units.parse_tokens` reads it ('1M' -> 1_000_000,
    '500k', '1.5M', '64Ki', '8192'); 'inf' / 'unbounded' -> None."""
    if text.strip().lower() in ("inf", "unbounded", "none"):
        return None
    return parse_tokens(text)


def parse_capacities(text: str) -> list[int | None]:
    """A comma-separated list of capacities, in the order given, duplicates dropped."""
    out: list[int | None] = []
    for part in text.split(","):
        if part.strip():
            cap = parse_capacity(part)
            if cap not in out:
                out.append(cap)
    if not out:
        raise ValueError("no capacity given")
    return out


def human_tokens(n: int | None) -> str:
    if n is None:
        return "unbounded"
    for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


@dataclass(slots=True)
class ReplayReport:
    """Everything one `radixserve replay` run measured."""

    trace: str
    format: str
    mode: str
    page_size: int
    block_size: int | None
    requests: int
    skipped_lines: list[str]
    concurrency: int
    warmup_fraction: float
    include_outputs: bool
    ceiling: ReplayStats
    points: list[ReplayStats] = field(default_factory=list)

    def point(self, policy: str, capacity: int | None) -> ReplayStats | None:
        for p in self.points:
            if p.policy == policy and p.capacity_tokens == capacity:
                return p
        return None

    def optimal_at(self, capacity: int | None) -> ReplayStats | None:
        return self.point(OPTIMAL, capacity)

    def gap_closed(self, p: ReplayStats) -> float | None:
        """(policy - LRU) / (optimal - LRU) at p's capacity: the share of the gap closed.

        None unless LRU and the optimal are both in the sweep and the gap is not empty.
        """
        lru = self.point(BASELINE, p.capacity_tokens)
        opt = self.optimal_at(p.capacity_tokens)
        if lru is None or opt is None or opt.hit_tokens == lru.hit_tokens:
            return None
        return (p.hit_tokens - lru.hit_tokens) / (opt.hit_tokens - lru.hit_tokens)

    def to_dict(self) -> dict:
        points = []
        for p in self.points:
            d = p.to_dict()
            opt = self.optimal_at(p.capacity_tokens)
            d["fraction_of_optimal"] = (p.hit_tokens / opt.hit_tokens
                                        if opt and opt.hit_tokens else None)
            d["fraction_of_ceiling"] = (p.hit_tokens / self.ceiling.hit_tokens
                                        if self.ceiling.hit_tokens else None)
            d["gap_closed"] = self.gap_closed(p)
            points.append(d)
        return {
            "trace": self.trace, "format": self.format, "mode": self.mode,
            "page_size": self.page_size, "block_size": self.block_size,
            "requests": self.requests, "skipped_lines": self.skipped_lines,
            "concurrency": self.concurrency, "warmup_fraction": self.warmup_fraction,
            "include_outputs": self.include_outputs,
            "ceiling": self.ceiling.to_dict(), "points": points,
        }


def format_table(report: ReplayReport) -> str:
    """A fixed-width table: one row per (capacity, policy), the ceiling last."""
    head = (f"{'capacity':>10} {'policy':>8} {'token hit':>9} {'req hit':>8} "
            f"{'saved tokens':>13} {'of optimal':>10} {'gap closed':>10} {'unfit':>6} "
            f"{'time s':>7}")
    lines = [f"trace {report.trace} ({report.format}, {report.requests} requests, "
             f"{report.mode} mode, page size {report.page_size}, concurrency "
             f"{report.concurrency}, warm-up {report.warmup_fraction:g}"
             f"{', outputs cached' if report.include_outputs else ''})", head,
             "-" * len(head)]
    for p in report.points:
        opt = report.optimal_at(p.capacity_tokens)
        of_opt = f"{p.hit_tokens / opt.hit_tokens:10.1%}" if opt and opt.hit_tokens else \
            f"{'-':>10}"
        gap = report.gap_closed(p)
        gap_text = f"{gap:10.1%}" if gap is not None else f"{'-':>10}"
        lines.append(f"{human_tokens(p.capacity_tokens):>10} {p.policy:>8} "
                     f"{p.token_hit_rate:9.2%} {p.request_hit_rate:8.2%} "
                     f"{p.hit_tokens:13,d} {of_opt} {gap_text} {p.unfit_requests:6d} "
                     f"{p.seconds:7.2f}")
    c = report.ceiling
    lines.append(f"{'ceiling':>10} {'-':>8} {c.token_hit_rate:9.2%} "
                 f"{c.request_hit_rate:8.2%} {c.hit_tokens:13,d} {'-':>10} {'-':>10} "
                 f"{c.unfit_requests:6d} {c.seconds:7.2f}")
    for p in [*report.points, c]:
        if p.miss_reasons:
            counts = ", ".join(f"{k} {v:,d}" for k, v in sorted(p.miss_reasons.items()))
            where = "ceiling" if p is c else f"{p.policy} @ {human_tokens(p.capacity_tokens)}"
            lines.append(f"miss reasons ({where}, requests): {counts}")
    lines.append(f"prompt tokens measured: {c.query_tokens:,d} over "
                 f"{c.measured_requests:,d} requests")
    if report.skipped_lines:
        lines.append(f"skipped {len(report.skipped_lines)} malformed line(s)")
    return "\n".join(lines)
