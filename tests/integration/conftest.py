"""Fixtures of the integration tests."""
from __future__ import annotations

import pytest

from .harness import Project


@pytest.fixture
def make_project(tmp_path, broker_url):
    """``make_project(body, **kwargs)``: a Project in its own directory, cleaned up after the test."""
    projects: list[Project] = []

    def make(body: str, **kwargs) -> Project:
        directory = tmp_path / f"p{len(projects)}"
        directory.mkdir()
        project = Project(directory, broker_url, body, **kwargs)
        projects.append(project)
        return project

    yield make
    errors = []
    for project in projects:
        try:
            project.cleanup()
        except Exception as exc:  # clean up the others anyway, then fail
            errors.append(exc)
    if errors:
        raise errors[0]
