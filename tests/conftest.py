"""Shared fixtures. Helpers the test modules import live in tests/support/ (tests/ is on sys.path: pytest's
rootdir conftest puts it there, so `from support.models import make_tiny_llama` works however pytest is started)."""

import os

import pytest
import torch

from support.models import make_tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: tiny models run many times faster than on two contended threads.
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()
