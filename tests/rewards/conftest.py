"""Reward tests run their tiny models on one torch thread (`one_torch_thread`, tests/conftest.py)."""
import pytest


@pytest.fixture(autouse=True, scope="module")
def _agents_on_one_thread(one_torch_thread):
    yield
