"""Rows of peer libraries, each consuming in its own virtualenv: faststream, celery-message-consumer,
celery-amqp-events (``python -m benchmarks --only faststream``; or ``--only peers`` for the three).

A peer never enters the project's environment: its row creates ``benchmarks/.peers/<name>/`` on first
use (git-ignored) with ``python -m venv`` and ``pip install`` of the pinned requirements below, and runs
the peer's consumer with that venv's python (``benchmarks`` is on its ``PYTHONPATH`` for the probe and
the apps, nothing else of this checkout). The Celery-based peers get this checkout's Celery and kombu
versions. ``python -m benchmarks.peers`` only creates (or checks) the venvs and prints the versions.

Each row is measured like the raw baselines (:func:`benchmarks.scenarios._throughput`): the consumer
starts, is paused, N persistent messages are published with pipelined confirms into its queue, it is
resumed; rate = N / (first handler start -> last ack), every id exactly once, the queues empty after.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from benchmarks import broker
from benchmarks.apps import celery_app
from benchmarks.procs import ROOT, Consumer
from benchmarks.scenarios import Context, Run, _env, _throughput

PEERS_DIR = ROOT / "benchmarks" / ".peers"
PREFETCH = 100
#: ``python -c EXEC VENV_PYTHON ARGS...``: procs.Consumer starts this checkout's python; it becomes the
#: venv's (same pid, same process group, so pause/resume/stop and the RSS sampler see the peer itself).
EXEC = "import os, sys; os.execv(sys.argv[1], sys.argv[1:])"


@dataclass(frozen=True)
class Peer:
    """A peer library: what its venv installs (pinned) and which distributions' versions to report."""

    name: str
    requirements: tuple[str, ...]
    report: tuple[str, ...]


def _same(dist: str) -> str:
    """``dist==<the version this checkout runs>`` (Celery-based peers run the project's Celery and kombu)."""
    return f"{dist}=={metadata.version(dist)}"


PEERS = {
    "faststream": Peer("faststream", ("faststream[rabbit]==0.7.8",),
                       ("faststream", "aio-pika", "aiormq", "fast-depends", "pydantic")),
    # flexisettings 1.0.5 (its only dependency) stopped requiring configloader[attrdict], without which its
    # settings have no attributes; attrdict (every version) imports collections.Mapping, gone since Python
    # 3.10: benchmarks/apps/peer_message_consumer.py aliases it before the import (see README).
    "celery-message-consumer": Peer(
        "celery-message-consumer",
        ("celery-message-consumer==1.2.1", "attrdict==2.0.1", _same("celery"), _same("kombu")),
        ("celery-message-consumer", "flexisettings", "attrdict", "celery", "kombu")),
    "celery-amqp-events": Peer("celery-amqp-events", ("celery-amqp-events==0.1.0", _same("celery"), _same("kombu")),
                               ("celery-amqp-events", "celery", "kombu")),
}

_shown: set[str] = set()


def python(name: str) -> Path:
    """The python of peer ``name``'s venv, created and installed on first use (again if the pins change)."""
    peer, venv = PEERS[name], PEERS_DIR / name
    exe, marker = venv / "bin" / "python", venv / "kebench-requirements.txt"
    wanted = "\n".join(peer.requirements) + "\n"
    if not (exe.exists() and marker.exists() and marker.read_text() == wanted):
        print(f"peer {name}: creating {venv} ({', '.join(peer.requirements)})", flush=True)
        venv.mkdir(parents=True, exist_ok=True)
        log = venv / "install.log"
        with open(log, "w") as fh:
            steps = ([sys.executable, "-m", "venv", "--clear", str(venv)],
                     [str(exe), "-m", "pip", "install", "--disable-pip-version-check", *peer.requirements])
            for cmd in steps:
                if subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode:
                    raise RuntimeError(f"peer {name}: {' '.join(cmd)} failed: {log.read_text()[-1500:]}")
        marker.write_text(wanted)
    if name not in _shown:
        _shown.add(name)
        print(f"peer {name}: {versions(name)} (python {exe})", flush=True)
    return exe


def versions(name: str) -> str:
    """``dist version, ...`` as installed in the peer's venv."""
    code = ("import json, sys; from importlib import metadata as m; "
            "print(json.dumps({d: m.version(d) for d in sys.argv[1:]}))")
    out = subprocess.run([str(PEERS_DIR / name / "bin" / "python"), "-c", code, *PEERS[name].report],
                         capture_output=True, text=True, check=True).stdout
    return ", ".join(f"{dist} {version}" for dist, version in json.loads(out).items())


def _consumer(name: str, args: list[str], env: dict[str, str], out: Path) -> Consumer:
    return Consumer(["-c", EXEC, str(python(name)), *args], env, out, name)


def _celery_worker(name: str, module: str, env: dict[str, str], out: Path, *extra: str) -> Consumer:
    """``celery -A module worker --pool=solo`` in the peer's venv, with the flags of the suite's workers."""
    args = ["-m", "celery", "-A", module, "worker", "--pool=solo", "--concurrency=1",
            "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "WARNING",
            f"--hostname=kebench-{name}-{os.getpid()}@%h", *extra]
    return _consumer(name, args, env, out)


def faststream(ctx: Context) -> Run:
    """faststream's RabbitBroker (aio-pika), one process, one subscriber on the queue, prefetch 100."""
    python("faststream")  # before the timer of anything: the venv may take a while the first time
    out, queue = ctx.directory("peer-faststream"), ctx.name("faststream")
    try:
        broker.declare_queue(ctx.url, queue, ctx.exchange, routing_key=queue)
        return _throughput(
            ctx, out,
            lambda: _consumer("faststream", ["-m", "benchmarks.apps.peer_faststream", ctx.url, queue],
                              _env(out, ctx.n, ctx.n, KEB_PREFETCH=str(PREFETCH)), out),
            lambda: broker.publish(ctx.url, broker.event_messages(ctx.exchange, [queue], ctx.n)),
            [queue], ctx.n)
    finally:
        broker.delete(ctx.url, queues=[queue])


def message_consumer(ctx: Context) -> Run:
    """celery-message-consumer: its ``AMQPRetryConsumerStep`` in a solo Celery worker, ``PREFETCH_COUNT`` 100."""
    python("celery-message-consumer")
    out, queue, task_queue = ctx.directory("peer-message-consumer"), ctx.name("msgconsumer"), ctx.name("tasks")
    own = [queue, f"{queue}.retry", f"{queue}.archived"]  # the step declares the retry and archive queues
    env = _env(out, ctx.n, ctx.n, KEB_BROKER=ctx.url, KEB_EXCHANGE=ctx.exchange, KEB_QUEUE=queue,
               KEB_TASKQ=task_queue, KEB_PREFETCH=str(PREFETCH))
    try:
        broker.declare_queue(ctx.url, queue, ctx.exchange, routing_key=queue)  # as the step declares it
        return _throughput(
            ctx, out,
            lambda: _celery_worker("celery-message-consumer", "benchmarks.apps.peer_message_consumer", env, out,
                                   "-Q", task_queue),
            lambda: broker.publish(ctx.url, broker.event_messages(ctx.exchange, [queue], ctx.n)),
            own, ctx.n)
    finally:
        broker.delete(ctx.url, queues=[*own, task_queue], exchanges=[task_queue])


#: The event (Celery task name and routing key) the celery-amqp-events row handles.
AMQP_EVENT = "kebench.noop_event"
AMQP_EVENTS_RETRIES = 10  # the library's default AMQP_EVENTS_MAX_RETRIES: as many retry queues


def amqp_events(ctx: Context) -> Run:
    """celery-amqp-events: a handler (a Celery task) in a solo worker, acks late, prefetch multiplier 100.

    Its handlers consume Celery task messages only, so this row publishes N task messages (protocol 2,
    JSON, persistent, ``args=(i,)``) to the run's exchange with the event's name as routing key, with the
    same pipelined confirms; the library's topology (its queue is bound to the exchange and to its
    ``recover`` exchange, with a dead-letter exchange) is the worker's, service name unique to the run.
    """
    python("celery-amqp-events")
    out, service = ctx.directory("peer-amqp-events"), ctx.name("amqpevents")
    queue = f"{service}.{AMQP_EVENT}"
    retry = [f"{service}:retry"] + [f"{service}:retry.{k}" for k in range(1, AMQP_EVENTS_RETRIES)]
    own = [queue, *retry, f"{service}:archived"]
    env = _env(out, ctx.n, ctx.n, KEB_BROKER=ctx.url, KEB_EXCHANGE=ctx.exchange, KEB_SERVICE=service,
               KEB_PREFETCH=str(PREFETCH), AMQP_EVENTS_MAX_RETRIES=str(AMQP_EVENTS_RETRIES))

    def publish() -> None:
        items = broker.celery_messages(celery_app.app, AMQP_EVENT, queue, ctx.n)
        broker.publish(ctx.url, [(ctx.exchange, AMQP_EVENT, message) for _, _, message in items])

    try:
        if ctx.cold:  # the worker declares the topology; --cold publishes before it starts: declare it as it does
            _declare_amqp_events_queue(ctx, service, queue)
        return _throughput(
            ctx, out,
            lambda: _celery_worker("celery-amqp-events", "benchmarks.apps.peer_amqp_events", env, out,
                                   "-Q", queue),
            publish, own, ctx.n)
    finally:
        broker.delete(ctx.url, queues=own, exchanges=[*retry, f"{service}:archived", f"{service}:recover"])


def _declare_amqp_events_queue(ctx: Context, service: str, queue: str) -> None:
    """The handler queue as ``EventsCelery._generate_task_queues`` declares it (its bindings, its DLX)."""
    from kombu import Connection, Exchange, Queue, binding

    events = Exchange(ctx.exchange, "topic", durable=True)
    recover = Exchange(f"{service}:recover", "topic", durable=True)
    with Connection(ctx.url) as conn:
        channel = conn.default_channel
        for exchange in (events, recover):
            exchange(channel).declare()
        Queue(queue, bindings=[binding(events, routing_key=AMQP_EVENT), binding(recover, routing_key=AMQP_EVENT)],
              queue_arguments={"x-dead-letter-exchange": f"{service}:retry"})(channel).declare()


def main() -> int:
    """Create (or check) every peer's venv and print what it holds."""
    for name in PEERS:
        python(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
