"""The pure core: outcome decisions, the settle planner, the wire format, the topology,
names, settings and policies. No socket, no kombu channel; imports only ``core`` and ``errors``.
"""
