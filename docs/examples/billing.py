from celery import Celery

from kombu_events import Events, poisonous

app = Celery("billing", broker="amqp://guest:guest@localhost//")
events = Events(app, service="billing")


def charge(order_id):
    raise NotImplementedError("calls the payment provider")


@events.handler("orders.*.created")
def on_order_created(payload):
    with poisonous():  # an order without an id will never have one: archive it at once
        order_id = payload["order_id"]
    charge(order_id)
