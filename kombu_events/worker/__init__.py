"""Inside a Celery worker: the bootstep, the consumer glue, the pool runner, screening
and announcing, Celery task-queue checks.
"""
