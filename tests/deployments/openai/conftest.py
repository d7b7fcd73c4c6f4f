"""The router fixtures these tests share with tests/deployments/test_router.py."""

from tests.deployments.test_router import make_router  # noqa: F401 (a fixture, found by name)
