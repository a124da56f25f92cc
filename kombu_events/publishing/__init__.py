"""Publishing from application code: the publisher, the local backlog and its policy,
the publisher's circuits and health checks.
"""
