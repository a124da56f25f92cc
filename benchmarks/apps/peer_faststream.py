"""Peer row ``faststream``: faststream's ``RabbitBroker`` consuming a queue the runner declared.

``<peer venv>/bin/python -m benchmarks.apps.peer_faststream URL QUEUE`` (see :mod:`benchmarks.peers`):
one process, faststream's own asyncio consumer (aio-pika), its defaults but three: the broker's default
channel has ``prefetch_count`` ``KEB_PREFETCH`` (100; faststream sets no QoS unless asked), the queue is
``RabbitQueue(QUEUE, declare=False)`` (a passive declare: the runner declared it durable and bound it;
faststream's own declaration would be non-durable), and faststream's logger is at WARNING (as the suite's
workers run with ``-l WARNING``). Its default ack policy (``REJECT_ON_ERROR``) acks each message after the
handler returns; every ``basic.ack`` (aio-pika's ``IncomingMessage.ack``) is counted. Stops on SIGTERM.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import aio_pika
from faststream.rabbit import RabbitBroker, RabbitQueue
from faststream.rabbit.schemas import Channel

from benchmarks import probe


def _count_acks() -> None:
    ack = aio_pika.IncomingMessage.ack

    async def ack_and_count(self, multiple: bool = False) -> None:
        await ack(self, multiple=multiple)
        probe.acked(1)

    aio_pika.IncomingMessage.ack = ack_and_count


async def main(url: str, queue: str) -> None:
    _count_acks()
    logger = logging.getLogger("kebench.faststream")
    logging.basicConfig(level=logging.WARNING)
    broker = RabbitBroker(url, default_channel=Channel(prefetch_count=int(os.environ.get("KEB_PREFETCH", "100"))),
                          logger=logger)

    @broker.subscriber(RabbitQueue(queue, declare=False))
    async def handle(body):
        probe.handled(body["i"])

    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    await broker.start()
    (probe.OUT / "ready").write_text("0")
    await stopping.wait()
    await broker.stop()
    probe.dump()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
