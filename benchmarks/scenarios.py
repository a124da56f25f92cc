"""The scenarios: each run publishes, measures one consumer or publisher, checks counts, deletes what it declared."""
from __future__ import annotations

import dataclasses
import itertools
import json
import socket
import statistics
import subprocess
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from benchmarks import broker
from benchmarks.apps import celery_app
from benchmarks.apps.events_app import build, make_app, routing_key
from benchmarks.procs import ROOT, Consumer, RssSampler

MiB = 1024 * 1024
GRACE_S = 0.5  # after the last expected ack: time for surplus deliveries to show up
WARM = 200  # warm-up messages before an idle RSS reading
WINDOW_S = 3.0  # RSS sampling window (idle, then waiting)


@dataclass
class Context:
    """One benchmark run: sizes, the broker, and the names it owns (all start with ``prefix``)."""

    url: str
    out: Path
    n: int = 20_000
    n_wait: int = 10_000
    n_latency: int = 1_000
    rate: float = 100.0
    batch: int = 1_000
    wait_s: float = 120.0
    cold: bool = False
    tree: Path | None = None  # events workers import kombu_events from this source tree (None: this checkout)
    prefix: str = field(default_factory=lambda: broker.unique("kebench-"))
    _seq: Any = field(default_factory=itertools.count)

    @property
    def exchange(self) -> str:
        """The events exchange of this run (shared by its scenarios, deleted at the end)."""
        return f"{self.prefix}.events"

    def name(self, what: str) -> str:
        return f"{self.prefix}.{what}{next(self._seq)}"

    def directory(self, what: str) -> Path:
        path = self.out / f"{next(self._seq):03d}-{what}"
        path.mkdir(parents=True)
        return path


@dataclass
class Run:
    """One measurement: ``value`` in the row's unit, or ``error`` (then ``value`` is None)."""

    value: float | None
    messages: int
    peak_rss: int = 0
    error: str | None = None
    extra: dict[str, float] = field(default_factory=dict)


class Failed(Exception):
    """The run did not handle exactly what it should have."""


# -- reading the probe's files ---------------------------------------------------------------------

@dataclass
class Probe:
    ok: list[int]
    fail: list[int]
    latencies: list[float]
    first: float
    acks: int


def read_probe(out: Path, n: int) -> Probe:
    """Sum the counters every consumer process dumped."""
    ok, fail, lat, firsts, acks = [0] * n, [0] * n, [], [], 0
    for meta_path in out.glob("proc-*.json"):
        meta = json.loads(meta_path.read_text())
        acks += meta["acks"]
        if meta["count"]:
            firsts.append(meta["first"])
        for total, suffix in ((ok, ".ok"), (fail, ".fail")):
            for i, c in enumerate(meta_path.with_suffix(suffix).read_bytes()):
                if c:
                    total[i] += c
        lat.extend(array("d", meta_path.with_suffix(".lat").read_bytes()))
    return Probe(ok, fail, lat, min(firsts, default=0.0), acks)


def check_exactly_once(counts: list[int], what: str) -> None:
    """Raise Failed unless every id was counted exactly once."""
    missing = sum(1 for c in counts if c == 0)
    extra = sum(c - 1 for c in counts if c > 1)
    if missing or extra:
        raise Failed(f"{what}: {len(counts) - missing} of {len(counts)} ids, {missing} missing, {extra} duplicates")


def check_none(counts: list[int], what: str) -> None:
    if any(counts):
        raise Failed(f"{what}: {sum(counts)} unexpected")


def check_depths(url: str, queues: list[str], expected: int, what: str) -> None:
    found = broker.depths(url, queues)
    total = sum(d or 0 for d in found.values())
    if total != expected:
        raise Failed(f"{what}: {total} messages in {len(queues)} queue(s), expected {expected}")


def _timeout(n: int) -> float:
    return 60 + n / 100  # generous for everything but the throughput runs, which watch progress instead


# -- consumer throughput -----------------------------------------------------------------------------

def _throughput(ctx: Context, out: Path, start: Callable[[], Consumer], publish: Callable[[], None],
                queues: list[str], acks: int, fails: bool = False) -> Run:
    """Publish N, consume them all; rate = N / (first delivery -> last ack); every id handled exactly once.

    By default the consumer starts first and is paused (SIGSTOP) while the N messages
    are published, so it starts from a full queue with its event loop already running;
    ``ctx.cold`` publishes before the consumer process starts instead.
    """
    if ctx.cold:
        publish()
        check_depths(ctx.url, queues, ctx.n, "published")
        consumer = start()
    else:
        consumer = start()
        try:
            consumer.wait_file("ready", 60, "consumer ready")
            consumer.pause()
            publish()  # confirmed and mandatory: every message reached a queue
            consumer.resume()
        except BaseException:
            consumer.stop()
            raise
    run = _measure(consumer, out, ctx.n, acks, fails, lambda: broker.depths(ctx.url, queues))
    return run if run.error else _after(run, ctx.url, queues)


def _measure(consumer: Consumer, out: Path, n: int, acks: int, fails: bool, progress) -> Run:
    """Wait for ``acks`` acks (failing if the queues stop moving); stop; check every id handled exactly once."""
    error = None
    try:
        # Celery's solo pool may stall for ~10 s at a time (DESIGN.md 7): no fixed deadline, a stall limit.
        last_ack = consumer.wait_file(f"acks-{acks}", 3600, f"{acks} acks", progress=progress)
        time.sleep(GRACE_S)
    except (RuntimeError, TimeoutError) as exc:
        error = str(exc)
    finally:
        consumer.stop()
    peak = consumer.sampler.peak()
    probe = read_probe(out, n)
    try:
        if error:
            raise Failed(error)
        check_exactly_once(probe.ok, "handled")
        (check_exactly_once if fails else check_none)(probe.fail, "failed attempts")
        if probe.acks != acks:
            raise Failed(f"{probe.acks} acks, expected {acks}")
    except Failed as exc:
        return Run(None, n, peak, f"{exc} (log: {consumer.log_path})")
    return Run(n / (last_ack - probe.first), n, peak)


def raw_consumer(ctx: Context, module: str = "raw_consumer") -> Run:
    """Baseline: raw kombu consumer (``module="raw_pika"``: pika), prefetch 100, manual ack."""
    out, queue = ctx.directory(module), ctx.name("raw")
    try:
        broker.declare_queue(ctx.url, queue, ctx.exchange, routing_key=queue)
        return _throughput(
            ctx, out,
            lambda: Consumer(["-m", f"benchmarks.{module}", ctx.url, queue], _env(out, ctx.n, ctx.n), out, "raw"),
            lambda: broker.publish(ctx.url, broker.event_messages(ctx.exchange, [queue], ctx.n)),
            [queue], ctx.n)
    finally:
        broker.delete(ctx.url, queues=[queue])


def celery_tasks(pool: str, concurrency: int) -> Callable[[Context], Run]:
    """Baseline: plain Celery no-op tasks with acks_late."""
    def run(ctx: Context) -> Run:
        out, queue = ctx.directory(f"celery-{pool}"), ctx.name("tasks")
        env = _env(out, ctx.n, ctx.n, KEB_TASKQ=queue)
        try:
            broker.declare_queue(ctx.url, queue)
            return _throughput(
                ctx, out,
                lambda: Consumer.celery("benchmarks.apps.celery_app", pool, concurrency, env, out, "-Q", queue),
                lambda: broker.publish(ctx.url, broker.celery_messages(celery_app.app, celery_app.NOOP, queue, ctx.n)),
                [queue], ctx.n)
        finally:
            broker.delete(ctx.url, queues=[queue], exchanges=[queue])
    return run


def events_consumer(pool: str, concurrency: int, mode: str = "noop", queues: int = 1,
                    tracing: float = 0, metrics: bool = False, prefetch: int | None = None,
                    fields: int = 1, share: float = 1.0, in_place_ms: int = 0) -> Callable[[Context], Run]:
    """kombu-events: handlers under ``celery worker --with-events-step``.

    ``tracing``: with TracingMiddleware sampling that share of traces (0: none, 1: all); ``metrics``: the
    worker serves Prometheus metrics (``--events-metrics-port``); ``prefetch``: the service's
    ``prefetch_count`` (per handler queue; default: the library's, see config.auto_prefetch);
    ``fields``: 1 for ``{"i": i}`` payloads, 5 for ``broker.order_payload`` (what mode ``typed`` validates);
    ``share``: of ``-n`` messages (the ``await``/``sleep`` rows wait 50 ms a message: a tenth);
    ``in_place_ms``: the service's ``retry_in_place_ms`` (0: every retry through the ladder).
    """
    def run(ctx: Context) -> Run:
        if share != 1.0:
            ctx = dataclasses.replace(ctx, n=max(1, int(ctx.n * share)))
        suffix = (f"-traced{tracing:g}" if tracing else "") + ("-metrics" if metrics else "")
        suffix += f"-p{prefetch}" if prefetch is not None else ""
        suffix += f"-{fields}f" if fields != 1 else ""
        suffix += f"-inplace{in_place_ms}" if in_place_ms else ""
        out = ctx.directory(f"events-{mode}-{pool}-{queues}q{suffix}")
        # a retry through the ladder acks the original and its copy; one in the worker, the original once
        acks = 2 * ctx.n if mode == "fail_once" and not in_place_ms else ctx.n
        more = {"KEB_RETRY_IN_PLACE_MS": str(in_place_ms)} if in_place_ms else {}
        keys = [routing_key(k) for k in range(queues)]
        extra = ("--events-metrics-port", str(_free_port())) if metrics else ()
        with _Service(ctx, mode=mode, queues=queues, tracing=tracing, prefetch=prefetch) as service:
            run = _throughput(
                ctx, out,
                lambda: service.worker(pool, concurrency, _env(out, ctx.n, acks, **more), out, *extra),
                lambda: broker.publish(ctx.url, broker.event_messages(ctx.exchange, keys, ctx.n, fields=fields)),
                service.handler_queues, acks, fails=mode == "fail_once")
            return run if run.error else _after(run, ctx.url, service.all_queues)
    return run


def _after(run: Run, url: str, queues: list[str]) -> Run:
    """With the consumer gone (unacked messages are back), every queue must be empty. The archive and a log are
    streams, which keep what they hold (the archive's first record says when it was opened), and a reader's
    position is one message: the runs count each message's ack."""
    kept = [q for q in queues if q.endswith(".archive") or ".log." in q or ".reader." in q]
    try:
        check_depths(url, [q for q in queues if q not in kept], 0, "left after the run")
    except Failed as exc:
        return Run(None, run.messages, run.peak_rss, str(exc))
    return run


def _env(out: Path, n: int, acks: int | str, **more: str) -> dict[str, str]:
    return {"KEB_OUT": str(out), "KEB_N": str(n), "KEB_ACKS": str(acks), **more}


class _Service:
    """A kombu-events service of the run: topology declared on entry, every entity deleted on exit."""

    def __init__(self, ctx: Context, mode: str, queues: int = 1, tracing: float = 0,
                 prefetch: int | None = None) -> None:
        self.ctx, self.mode, self.queues, self.tracing, self.prefetch = ctx, mode, queues, tracing, prefetch
        self.name = ctx.name("svc")
        self.task_queue = f"{self.name}.tasks"
        app = make_app("kebench-runner", ctx.url, self.task_queue)
        self.events = build(app, service=self.name, exchange=ctx.exchange, mode=mode, queues=queues,
                            wait_s=ctx.wait_s)
        topology = self.events.topology()
        self.handler_queues = [q.name for q in topology.handler_queues]
        self.all_queues = [q.name for q in topology.queues]
        self.ladder_queues = [q for q in self.all_queues if q.startswith(f"{self.name}.delay.")]
        self.exchanges = [e.name for e in topology.exchanges if e.name != ctx.exchange]

    def __enter__(self) -> _Service:
        broker.declare_events(self.ctx.url, self.events)
        return self

    def __exit__(self, *exc: Any) -> None:
        broker.delete(self.ctx.url, queues=[*self.all_queues, self.task_queue],
                      exchanges=[*self.exchanges, self.task_queue])

    def worker(self, pool: str, concurrency: int, env: dict[str, str], out: Path, *extra: str) -> Consumer:
        env = {**env, "KEB_SERVICE": self.name, "KEB_EXCHANGE": self.ctx.exchange, "KEB_BROKER": self.ctx.url,
               "KEB_TASKQ": self.task_queue, "KEB_MODE": self.mode, "KEB_QUEUES": str(self.queues),
               "KEB_WAIT_S": str(self.ctx.wait_s), **({"KEB_TRACING": str(self.tracing)} if self.tracing else {}),
               **({"KEB_PREFETCH": str(self.prefetch)} if self.prefetch is not None else {})}
        return Consumer.celery("benchmarks.apps.events_app", pool, concurrency, env, out,
                               "--with-events-step", "-Q", self.task_queue, *extra, tree=self.ctx.tree)


def _free_port() -> int:
    """A TCP port nothing listens on now (for a worker's metrics endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- publishing ---------------------------------------------------------------------------------------

def publisher(mode: str) -> Callable[[Context], Run]:
    """Publish N messages from a separate process; count what reached the queue."""
    def run(ctx: Context) -> Run:
        from benchmarks.publish import WARMUP

        out, queue = ctx.directory(f"publish-{mode}"), ctx.name("sink")
        try:
            broker.declare_queue(ctx.url, queue, ctx.exchange, routing_key=queue)
            result, peak = _publish_process(ctx, out, mode, queue, ctx.n)
            check_depths(ctx.url, [queue], ctx.n + WARMUP, "published")
            return Run(ctx.n / result["seconds"], ctx.n, peak)
        except Failed as exc:
            return Run(None, ctx.n, 0, str(exc))
        finally:
            broker.delete(ctx.url, queues=[queue])
    return run


def _publish_process(ctx: Context, out: Path, mode: str, key: str, n: int) -> tuple[dict, int]:
    cmd = [sys.executable, "-m", "benchmarks.publish", mode, ctx.url, ctx.exchange, key, str(n),
           f"--batch={ctx.batch}", f"--rate={ctx.rate}"]
    with open(out / "publisher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        sampler = RssSampler(proc.pid)
        sampler.start()
        try:
            stdout, _ = proc.communicate(timeout=_timeout(n) + n / ctx.rate)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise Failed(f"publisher did not finish {n} messages in time: see {out / 'publisher.log'}") from None
        finally:
            sampler.stop()
    if proc.returncode:
        raise Failed(f"publisher exited with {proc.returncode}: see {out / 'publisher.log'}")
    return json.loads(stdout), sampler.peak()


# -- latency --------------------------------------------------------------------------------------------

def latency(kind: str, pool: str = "solo", concurrency: int = 1) -> Callable[[Context], Run]:
    """Publish -> handler start at ``ctx.rate`` msgs/s into a running consumer; value = p50 in ms."""
    def run(ctx: Context) -> Run:
        from benchmarks.publish import LATENCY_WARMUP

        out, n = ctx.directory(f"latency-{kind}-{pool}"), ctx.n_latency
        acks = n + LATENCY_WARMUP
        if kind == "raw":
            queue = ctx.name("rawlat")
            try:
                broker.declare_queue(ctx.url, queue, ctx.exchange, routing_key=queue)
                consumer = Consumer(["-m", "benchmarks.raw_consumer", ctx.url, queue, "latency"],
                                    _env(out, n, acks), out, "raw")
                return _latency_run(ctx, consumer, out, queue, n, acks)
            finally:
                broker.delete(ctx.url, queues=[queue])
        with _Service(ctx, mode="latency") as service:
            consumer = service.worker(pool, concurrency, _env(out, n, acks), out)
            return _latency_run(ctx, consumer, out, routing_key(0), n, acks)
    return run


def _latency_run(ctx: Context, consumer: Consumer, out: Path, key: str, n: int, acks: int) -> Run:
    try:
        consumer.wait_file("ready", 60, "consumer ready")
        time.sleep(1.0)  # let the consumer settle into its loop
        _publish_process(ctx, out, "latency", key, n)
        consumer.wait_file(f"acks-{acks}", _timeout(n), f"{acks} acks")
        time.sleep(GRACE_S)
    except (RuntimeError, TimeoutError, Failed) as exc:
        consumer.stop()
        return Run(None, n, consumer.sampler.peak(), f"{exc} (log: {consumer.log_path})")
    consumer.stop()
    probe = read_probe(out, n)
    try:
        check_exactly_once(probe.ok, "handled")
        if len(probe.latencies) != n or probe.acks != acks:
            raise Failed(f"{len(probe.latencies)} latencies and {probe.acks} acks, expected {n} and {acks}")
    except Failed as exc:
        return Run(None, n, consumer.sampler.peak(), str(exc))
    ms = sorted(x * 1000 for x in probe.latencies)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return Run(statistics.median(ms), n, consumer.sampler.peak(), extra={"p99": p99, "max": ms[-1]})


# -- RSS while retries wait ------------------------------------------------------------------------------

def events_waiting_rss(pool: str = "prefork", concurrency: int = 2) -> Callable[[Context], Run]:
    """RSS growth of the worker while N messages wait ``wait_s`` in the broker's delay ladder."""
    def run(ctx: Context) -> Run:
        out, n = ctx.directory(f"rss-events-{pool}"), ctx.n_wait
        with _Service(ctx, mode="wait") as service:
            consumer = service.worker(pool, concurrency, _env(out, n, f"{WARM},{WARM + n}"), out)

            def publish_warm() -> None:
                broker.publish(ctx.url, broker.event_messages(ctx.exchange, [routing_key(0)], WARM, warm=True))

            def publish_waiting() -> None:
                broker.publish(ctx.url, broker.event_messages(ctx.exchange, [routing_key(0)], n))

            def all_waiting() -> None:
                check_depths(ctx.url, service.handler_queues, 0, "still in the handler queue")
                check_depths(ctx.url, service.ladder_queues, n, "waiting in the ladder")

            def after_stop(probe: Probe) -> None:
                check_exactly_once(probe.fail, "failed first attempts")
                check_none(probe.ok, "handled before their delay was over")

            return _waiting_rss(consumer, out, n, publish_warm, publish_waiting, WARM + n, all_waiting, after_stop)
    return run


def celery_countdown_rss(pool: str = "prefork", concurrency: int = 2) -> Callable[[Context], Run]:
    """Baseline: RSS growth of a Celery worker holding N tasks retried with ``self.retry(countdown=wait_s)``.

    The N tasks are published as that retry republishes them (``eta`` set, ``retries=1``):
    Celery fetches an ETA task only by raising its prefetch by one per loop turn, which
    here takes seconds per task, so running the first attempts in the worker would not
    get 10,000 into its memory within the countdown. The prefetch multiplier is raised
    so that all N fit at once; the worker then holds them exactly as it holds retries.
    """
    def run(ctx: Context) -> Run:
        out, n, queue = ctx.directory(f"rss-celery-{pool}"), ctx.n_wait, ctx.name("tasks")
        app = celery_app.app
        try:
            broker.declare_queue(ctx.url, queue)
            env = _env(out, n, str(WARM), KEB_TASKQ=queue, KEB_WAIT_S=str(ctx.wait_s),
                       KEB_PREFETCH_MULTIPLIER=str(-(-(n + WARM) // concurrency)))
            consumer = Consumer.celery("benchmarks.apps.celery_app", pool, concurrency, env, out, "-Q", queue)

            def publish_warm() -> None:
                broker.publish(ctx.url, broker.celery_messages(app, celery_app.COUNTDOWN, queue, WARM, {"warm": True}))

            def publish_waiting() -> None:
                broker.publish(ctx.url, broker.celery_messages(
                    app, celery_app.COUNTDOWN, queue, n, countdown=ctx.wait_s, retries=1))

            def all_waiting() -> None:  # every task delivered to (and held by) the worker
                deadline = time.monotonic() + 60
                while broker.depth(ctx.url, queue):
                    if time.monotonic() > deadline:
                        raise Failed(f"{broker.depth(ctx.url, queue)} of {n} ETA tasks still in the queue after 60 s")
                    time.sleep(0.1)

            def after_stop(probe: Probe) -> None:  # the worker gave them all back, none ran
                check_none(probe.ok, "ran before their countdown")
                check_depths(ctx.url, [queue], n, "returned to the queue by the stopped worker")

            return _waiting_rss(consumer, out, n, publish_warm, publish_waiting, None, all_waiting, after_stop)
        finally:
            broker.delete(ctx.url, queues=[queue], exchanges=[queue])
    return run


def _waiting_rss(consumer: Consumer, out: Path, n: int, publish_warm, publish_waiting, acks: int | None,
                 all_waiting, after_stop) -> Run:
    """Idle RSS after a warm-up, then RSS while ``n`` messages wait; value = growth in MiB."""
    try:
        consumer.wait_file("ready", 60, "worker ready")
        publish_warm()
        consumer.wait_file(f"acks-{WARM}", 60, "warm-up acks")
        time.sleep(1.0)
        t0 = time.time()
        time.sleep(WINDOW_S)
        idle = consumer.sampler.peak(t0)
        publish_waiting()
        if acks:
            consumer.wait_file(f"acks-{acks}", _timeout(n), f"{n} failed first attempts acked")
        all_waiting()
        t1 = time.time()
        time.sleep(WINDOW_S)
        waiting = consumer.sampler.peak(t1)
        all_waiting()  # still all waiting: the window measured what it should
    except (RuntimeError, TimeoutError, Failed) as exc:
        consumer.stop()
        return Run(None, n, consumer.sampler.peak(), f"{exc} (log: {consumer.log_path})")
    consumer.stop()
    try:
        after_stop(read_probe(out, n))
    except Failed as exc:
        return Run(None, n, consumer.sampler.peak(), str(exc))
    return Run((waiting - idle) / MiB, n, consumer.sampler.peak(),
               extra={"idle_mib": idle / MiB, "waiting_mib": waiting / MiB})
