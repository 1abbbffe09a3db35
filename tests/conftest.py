import pytest
import torch

from dmattn_ops import _alloc


@pytest.fixture(autouse=True)
def poison_library_allocations(monkeypatch):
    """Fill every output the library allocates with NaN: an unwritten element fails loudly."""
    monkeypatch.setattr(_alloc, "POISON", True)


@pytest.fixture(autouse=True)
def fixed_seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
