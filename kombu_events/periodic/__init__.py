"""Periodic events: the schedule store of a service and the handler that runs its tokens."""
