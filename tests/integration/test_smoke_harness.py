"""The harness itself: a worker with the events step handles an event from a Node.js publisher."""
import json

import pytest

from .harness import Project, node_publish, wait_for

pytestmark = pytest.mark.integration

APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("orders.*.created")
def on_created(payload):
    record(handler="on_created", payload=payload)
"""


def test_node_publisher_reaches_handler(tmp_path, broker_url):
    exchange = "ex" + tmp_path.name[-8:]
    project = Project(tmp_path, broker_url, APP.replace("EXCHANGE", repr(exchange)))
    try:
        project.worker().wait_ready()
        node_publish(broker_url, exchange, [{"routing_key": "orders.42.created",
                                            "body": json.dumps({"order_id": 42}),
                                            "properties": {"contentType": "application/json"}}])
        records = wait_for(project.records, what="handler record")
        assert records[0]["payload"] == {"order_id": 42}
    finally:
        project.cleanup()
