"""Two source trees, one run: ``python -m benchmarks.compare --before DIR [--after DIR] [--rounds 3] [-n 20000]``.

Runs rows of the suite (default ``events-solo,events-prefork``: a no-op handler, N
persistent messages, ``--pool=solo`` / ``--pool=prefork -c 2``) with workers that import
``kombu_events`` from ``--before`` (e.g. ``git worktree add /tmp/ke-before <commit>``) and
from ``--after`` (default: this checkout), interleaved: in each round every row runs once
per tree, ``before`` first in odd rounds and ``after`` first in even ones, so that drift of
the machine hits both alike. Everything else -- the benchmark app, the runner, and the
``kombu_events`` the runner declares the topology and publishes with -- is this checkout's.

Printed: each run's rate; then per row the median (min-max) of each tree, the ratio of
the medians after/before, the ratio within each round, and the verdict: ``within noise`` if
the two trees' min-max ranges overlap and the per-round ratios lie on both sides of 1,
``OUTSIDE noise`` if the ranges do not overlap, else a warning that one tree won every
round (run more rounds). The exit status is 1 if any run failed.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import suite
from benchmarks.__main__ import DEFAULT_URL, clean
from benchmarks.breaker_scenario import _commit as commit_of
from benchmarks.procs import ROOT, Consumer
from benchmarks.scenarios import Context, Run

#: Rows whose workers are events workers (the only processes that import kombu_events).
COMPARABLE = tuple(r.key for r in suite.ROWS
                   if r.unit == "msgs/s" and r.group.split()[-1] in ("success", "retry", "scale"))
TREES = ("before", "after")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="source tree of the code before (holds kombu_events/)")
    p.add_argument("--after", type=Path, default=ROOT, help="source tree of the code after (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds: each row once per tree (default %(default)s)")
    p.add_argument("-n", type=int, default=20_000, help="messages per run (default %(default)s)")
    p.add_argument("--scenarios", default="events-solo,events-prefork",
                   help=f"comma-separated rows (default %(default)s) of: {', '.join(COMPARABLE)}")
    p.add_argument("--baseline", action="store_true",
                   help="also run each row's baseline (raw kombu, events-solo...) once per round, between the trees, "
                        "and print each tree's same-run ratio to it")
    p.add_argument("--with", dest="also", default="",
                   help="other rows to run once per round with the baselines (e.g. raw-pika,celery-prefork); "
                        "each tree's rows are shown as ratios to them too")
    p.add_argument("--broker", default=DEFAULT_URL, help="AMQP URL (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the per-run directories (logs, probe files)")
    a = p.parse_args(argv)
    a.scenarios = [k.strip() for k in a.scenarios.split(",") if k.strip()]
    unknown = [k for k in a.scenarios if k not in COMPARABLE]
    if unknown:
        p.error(f"not comparable: {', '.join(unknown)}; choose from {', '.join(COMPARABLE)}")
    for tree in (a.before, a.after):
        if not (tree / "kombu_events" / "__init__.py").is_file():
            p.error(f"{tree} has no kombu_events/__init__.py")
    a.before, a.after = a.before.resolve(), a.after.resolve()
    return a


def spread(values: list[float]) -> str:
    """``median (min-max) +-x %``: the half-range relative to the median."""
    mid = statistics.median(values)
    return (f"{mid:,.0f} ({min(values):,.0f}-{max(values):,.0f}) "
            f"+-{(max(values) - min(values)) / 2 / mid * 100:.0f} %")


def summary(key: str, runs: dict[str, list[Run]]) -> str:
    """One row's line: both trees, the ratios, the verdict."""
    failed = [r for tree in TREES for r in runs[tree] if r.error]
    if failed:
        return f"{key}: FAIL ({len(failed)} run(s)): {failed[0].error}"
    before, after = ([r.value for r in runs[tree]] for tree in TREES)
    ratio = statistics.median(after) / statistics.median(before)
    rounds = [a / b for b, a in zip(before, after)]
    if max(min(before), min(after)) > min(max(before), max(after)):
        verdict = f"OUTSIDE noise: after is {ratio:.2f}x before, the ranges do not overlap"
    elif len(rounds) > 1 and (min(rounds) > 1 or max(rounds) < 1):
        verdict = (f"within the spread (ranges overlap), but after is {'faster' if min(rounds) > 1 else 'slower'} "
                   "in every round: run more rounds, on a quieter machine")
    else:
        verdict = "within noise (ranges overlap, per-round ratios on both sides of 1)"
    return (f"{key}:\n  before  {spread(before)} msgs/s\n  after   {spread(after)} msgs/s\n"
            f"  after/before {ratio:.2f}x (per round: {' '.join(f'{r:.2f}x' for r in rounds)}); {verdict}")


def ratios(rows: list[suite.Row], results: dict[str, dict[str, list[Run]]], base: dict[str, list[Run]]) -> None:
    """Each tree's same-run ratio of a row to its baseline: of the medians, and per round."""
    for row in rows:
        for tree in TREES:
            key = row.baseline or ""
            theirs, mine = base.get(key) or results.get(key, {}).get(tree), results[row.key][tree]
            if not theirs or any(r.error for r in mine + theirs):
                continue
            mid = statistics.median(r.value for r in mine) / statistics.median(r.value for r in theirs)
            each = " ".join(f"{m.value / t.value:.2f}x" for m, t in zip(mine, theirs))
            print(f"  {row.key} / {key}, {tree:<6}: {mid:.2f}x of the medians (per round: {each})")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    rows = [r for key in a.scenarios for r in suite.ROWS if r.key == key]
    baselines = sorted({r.baseline for r in rows if a.baseline and r.baseline and r.baseline not in a.scenarios})
    also = [k.strip() for k in a.also.split(",") if k.strip()]
    baselines += [k for k in also if k not in baselines]
    base_rows = [r for r in suite.ROWS if r.key in baselines and r.key not in COMPARABLE]
    base: dict[str, list[Run]] = {r.key: [] for r in base_rows}
    trees = {"before": a.before, "after": a.after}
    workdir = Path(tempfile.mkdtemp(prefix="kebench-"))
    ctx = Context(url=a.broker, out=workdir, n=a.n)
    print(f"compare: {', '.join(a.scenarios)}; {a.rounds} round(s), N={a.n:,} per run; "
          f"names start with {ctx.prefix}; files in {workdir}", flush=True)
    for name, tree in trees.items():
        print(f"  {name:<6} {tree}/kombu_events{commit_of(str(tree))}", flush=True)
    results: dict[str, dict[str, list[Run]]] = {r.key: {t: [] for t in TREES} for r in rows}
    try:
        for rnd in range(1, a.rounds + 1):
            order = TREES if rnd % 2 else TREES[::-1]  # before-after, after-before, ...: linear drift cancels
            for row in base_rows:  # not an events worker: the same for both trees
                base[row.key].append(row.attempt(ctx))
                shown = base[row.key][-1].error or f"{base[row.key][-1].value:,.0f} msgs/s"
                print(f"[{rnd}/{a.rounds}] {row.key:<16} {'both':<6} {shown}", flush=True)
            for row in rows:
                for name in order:
                    ctx.tree = trees[name]
                    started = time.monotonic()
                    run = row.attempt(ctx)
                    results[row.key][name].append(run)
                    shown = run.error or f"{run.value:,.0f} msgs/s"
                    print(f"[{rnd}/{a.rounds}] {row.key:<16} {name:<6} {shown}  "
                          f"({time.monotonic() - started:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("interrupted: reporting what ran", file=sys.stderr)
    finally:
        Consumer.stop_all()
        clean(ctx)
    print()
    for key, runs in results.items():
        if all(runs[t] for t in TREES):
            print(summary(key, runs))
    if a.baseline:
        print("same-run ratios:")
        ratios(rows, results, base)
        for key in also:
            ratios([suite.Row(r.key, r.group, r.label, r.unit, r.run, key) for r in rows if r.key.startswith("events")],
                   results, base)
    if a.keep:
        print(f"\nlogs in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if any(r.error for runs in results.values() for t in TREES for r in runs[t]) else 0


if __name__ == "__main__":
    sys.exit(main())
