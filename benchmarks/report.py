"""Turn the runs into the table: median (min-max), ratio to the baseline, target met or missed."""
from __future__ import annotations

import statistics
from typing import Iterable

from benchmarks.scenarios import MiB, Run
from benchmarks.suite import Row

HEADER = ("group", "scenario", "messages", "result: median (min-max)", "ratio to baseline", "target",
          "peak RSS")


def median(runs: list[Run]) -> float | None:
    """Median value, or None if any repetition failed."""
    if not runs or any(r.error for r in runs):
        return None
    return statistics.median(r.value for r in runs)


def _number(value: float, unit: str) -> str:
    if unit == "msgs/s":
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) < 100 else f"{value:,.0f}"


def _result(row: Row, runs: list[Run]) -> str:
    failed = [r for r in runs if r.error]
    if failed:
        return f"FAIL ({len(failed)}/{len(runs)}): {failed[0].error}"
    values = [r.value for r in runs]
    low, high = _number(min(values), row.unit), _number(max(values), row.unit)
    text = f"{_number(median(runs), row.unit)} ({low}-{high}) {row.unit}"
    if row.unit == "ms":
        p99 = statistics.median(r.extra["p99"] for r in runs)
        text = f"p50 {text}, p99 {p99:.2f} ms"
    elif row.unit == "MiB":
        idle = statistics.median(r.extra["idle_mib"] for r in runs)
        waiting = statistics.median(r.extra["waiting_mib"] for r in runs)
        text += f" (idle {idle:.0f} -> waiting {waiting:.0f} MiB)"
    return text


def _ratio_and_target(row: Row, value: float | None, base: float | None) -> tuple[str, str]:
    ratio = None if value is None or not base else value / base
    ratio_text = "baseline" if row.baseline is None else ("n/a" if ratio is None else f"{ratio:.2f}x")
    if row.target is None:
        return ratio_text, ""
    if row.unit == "msgs/s":
        goal, met = f">= {row.target:g}x", ratio is not None and ratio >= row.target
    else:
        goal, met = f"< {row.target:g} {row.unit}", value is not None and value < row.target
    return ratio_text, f"{goal} {'met' if met else 'MISSED'}"


def table(rows: Iterable[Row], results: dict[str, list[Run]], fmt: dict) -> list[list[str]]:
    """One list of cells per row."""
    lines = []
    for row in rows:
        runs = results.get(row.key, [])
        value = median(runs)
        base = median(results.get(row.baseline, [])) if row.baseline else None
        ratio, target = _ratio_and_target(row, value, base)
        peaks = [r.peak_rss for r in runs if r.peak_rss]
        peak = f"{statistics.median(peaks) / MiB:.0f} MiB" if peaks else ""
        messages = f"{runs[0].messages:,}" if runs else ""
        lines.append([row.group, row.label.format(**fmt), messages, _result(row, runs) if runs else "not run",
                      ratio, target, peak])
    return lines


def markdown(cells: list[list[str]]) -> str:
    """A Markdown table (also readable in a terminal)."""
    widths = [max(len(str(c)) for c in column) for column in zip(HEADER, *cells)]

    def line(values) -> str:
        return "| " + " | ".join(str(v).ljust(w) for v, w in zip(values, widths)) + " |"

    return "\n".join([line(HEADER), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])
