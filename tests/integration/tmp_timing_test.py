import time, json
from tests.integration.harness import Project, node_publish, wait_for, delete_service
APP = """
events = Events(app, service=SERVICE, exchange='extiming1')
@events.handler("orders.*.created")
def on_created(payload):
    record(handler="on_created", payload=payload)
"""
def test_t(tmp_path):
    url="amqp://guest:guest@127.0.0.1:5672//"
    p=Project(tmp_path,url,APP)
    w=p.worker("--loglevel=DEBUG"); w.wait_ready()
    node_publish(url,'extiming1',[{"routing_key":"orders.1.created","body":"{}","properties":{}}])
    wait_for(p.records)
    t3=time.monotonic()
    for x in p.workers: x.stop()
    t4=time.monotonic()
    delete_service(url,p.service,("extiming1",))
    print("stop",t4-t3)
    print(w.log[-3000:])
