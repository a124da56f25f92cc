"""The tutorial's service: two handlers of orders.*.created events, one with a bug."""
import os

from celery import Celery

from kombu_events import Event, Events, Exponential

BROKER = os.environ.get("RABBIT_URL", "amqp://guest:guest@127.0.0.1:5672//")
app = Celery("shop", broker=BROKER)
events = Events(
    app,
    service="shop",     # prefixes every queue: shop.send_receipt, shop.archive, ...
    max_retries=2,      # 1 attempt + 2 retries, then the archive
    backoff=Exponential(base_ms=1000, max_delay_ms=4000),  # 1 s, then 2 s
    delay_levels=4,     # a ladder of 4 levels of 1 s: delays up to 15 s
    publish_delay_levels=4,  # the same for events.publish(..., delay=...) on "events"
)


@events.handler("orders.*.created", bind=True)
def send_receipt(event: Event) -> None:
    """Fails on its first attempt, as if the mail server were busy."""
    if event.attempt == 1:
        raise ConnectionError("mail server busy")
    order = event.payload["order_id"]
    print(f"receipt sent for order {order} (attempt {event.attempt})")


@events.handler("orders.*.created")
def reserve_stock(payload: dict) -> None:
    """Has a bug: an order without "sku" raises KeyError, every time."""
    print(f"reserved {payload['sku']} for order {payload['order_id']}")
