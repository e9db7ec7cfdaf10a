"""Shared fixtures. Helpers the test modules import live in tests/support/ (tests/ is on sys.path: pytest's
rootdir conftest puts it there, so `from support.models import make_tiny_llama, tiny_byte_target_and_drafter` works however pytest is started)."""

import os

import pytest
import torch

from support.models import make_tiny_llama, tiny_byte_target_and_drafter

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


@pytest.fixture(scope="module")
def tiny():
    """(target, drafter): a tiny random Llama behind a byte-level chat tokenizer and an untrained EAGLE-3 drafter
    (support.models.tiny_byte_target_and_drafter), built once per module."""
    return tiny_byte_target_and_drafter()
