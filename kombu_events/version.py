"""The version of kombu-events (read by setuptools without importing the package)."""

__version__ = "0.2.0"
