"""Middleware: the base class, what middleware may do to a running service, and the middlewares the library installs."""
