"""Latency histograms as the benchmark scripts keep them: {bucket key: count}.

Keys: latency_us // 10 below 10 ms (10 us resolution), 1000 + latency_us // 1000 above (1 ms)."""

from __future__ import annotations

import math
from collections.abc import Iterable


def hist_key(latency_us: int) -> int:
    return latency_us // 10 if latency_us < 10_000 else 1000 + latency_us // 1000


def hist_value_ms(key: int) -> float:
    return (key * 10 + 5) / 1000 if key < 1000 else (key - 1000) + 0.5


def hist_percentiles(hist: dict[int, int], qs: tuple[float, ...]) -> dict[str, float | None]:
    total = sum(hist.values())
    out: dict[str, float | None] = {}
    if total == 0:
        return {f"p{q:g}": None for q in qs}
    ordered = sorted(hist.items())
    for q in qs:
        rank = max(1, math.ceil(total * q / 100))
        seen = 0
        for key, count in ordered:
            seen += count
            if seen >= rank:
                out[f"p{q:g}"] = round(hist_value_ms(key), 3)
                break
    return out


def hist_latency_ms(hist: dict[int, int], qs: tuple[float, ...]) -> dict[str, float | None]:
    """The percentiles `qs` and the maximum, in ms."""
    return {**hist_percentiles(hist, qs), "max": round(hist_value_ms(max(hist)), 3) if hist else None}


def merge_hists(hists: Iterable[dict[str | int, int]]) -> dict[int, int]:
    """One histogram from several (keys as the JSON of a report has them, strings, or ints)."""
    out: dict[int, int] = {}
    for hist in hists:
        for k, v in hist.items():
            out[int(k)] = out.get(int(k), 0) + v
    return out
