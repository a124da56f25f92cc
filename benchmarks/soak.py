"""Soak: the everything-on scenario of tests/integration/test_everything_on.py for as long as asked.

    python -m benchmarks.soak --minutes 30 --pool prefork [--seed S] [--events 2000] [--keep]

One service with every feature on (``tests/integration/everything_app.py``) on a RabbitMQ
node of its own (``scripts/rabbitmq-cluster``, on free loopback ports; 5672 is never
touched). Cycles of ``--events`` events from the Node.js publisher follow each other
until ``--minutes`` have passed; each cycle injects every fault once, in order
(``tests/integration/everything.py``: ``FAULTS``). Then the run waits for every event and
prints the accounting; exit status 1 if it found a problem. The scenario, the service,
the proxy and the accounting are the test's own modules, imported, not copied.
"""
from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tests.integration.everything import Scenario, faults_for
from tests.integration.private_broker import PrivateBroker

#: Figures printed at the end, in this order (the accounting's names).
SUMMARY = ("events sent", "faults injected", "handled", "duplicates", "lost", "archived", "worker exits (own)",
           "'Unrecoverable error' lines")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="start cycles until this much time has passed")
    parser.add_argument("--pool", choices=("prefork", "solo"), default="prefork")
    parser.add_argument("--events", type=int, default=2000, help="events per cycle (default 2000)")
    parser.add_argument("--seed", default=None, help="replay a run (default: random, printed)")
    parser.add_argument("--keep", action="store_true", help="keep worker logs and records (kept anyway on failure)")
    args = parser.parse_args(argv)
    seed = args.seed or str(random.SystemRandom().randrange(1_000_000))
    directory = Path(tempfile.mkdtemp(prefix="kebench-soak-"))
    print(f"soak: {args.minutes:g} min, pool {args.pool}, {args.events} events per cycle, faults per cycle: "
          f"{', '.join(faults_for(args.pool))}; SEED={seed}; "
          f"files in {directory}", flush=True)
    broker = PrivateBroker(directory / "rabbitmq")
    broker.start()
    problems = True
    try:
        problems = _run(broker, directory, args, seed)
    finally:
        strays = broker.stop()
        if strays:
            print(f"soak: beam processes of the private node outlived its stop (killed): {strays}")
        if problems or args.keep:
            print(f"soak: logs and records kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    return 1 if problems else 0


def _run(broker: PrivateBroker, directory: Path, args: argparse.Namespace, seed: str) -> bool:
    """Cycles until the time is up, then the accounting; whether it found problems."""
    scenario = Scenario(broker, directory / "run", pool=args.pool, seed=seed, events=args.events,
                        log=lambda line: print(line, flush=True))
    deadline = time.monotonic() + args.minutes * 60
    try:
        scenario.start()
        cycle = 0
        while time.monotonic() < deadline:
            scenario.cycle(cycle)
            caught_up = scenario.wait_handled(timeout=120)
            ledger = scenario.ledger
            print(f"soak: cycle {cycle} done ({'every event handled' if caught_up else 'events still pending'}); "
                  f"sent {ledger.sent}, worker exits (own) {len(ledger.exited)}, "
                  f"fault problems {len(ledger.fault_problems)}", flush=True)
            cycle += 1
        report = scenario.finish(timeout=180)
    finally:
        scenario.close()
    print("\nsoak: figures")
    for name in SUMMARY:
        print(f"  {name}: {report.figures.get(name)}")
    for name, value in report.figures.items():
        if name not in SUMMARY:
            print(f"  {name}: {value}")
    print(f"soak: {len(report.problems)} problem(s)")
    for problem in report.problems:
        print(f"  PROBLEM: {problem}")
    return bool(report.problems)


if __name__ == "__main__":
    sys.exit(main())
