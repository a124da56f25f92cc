"""Talking to RabbitMQ, for every part that does: declares and passive peeks, pipelined
confirms, bounded waits on a connection, lenient py-amqp decoding.
"""
