import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. It is chosen when a kernel is
# decorated, so it must be set before dmattn_ops (and its kernels) are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Dense calls on CUDA would run PyTorch's flash kernels (dmattn_ops/executors/sdpa.py); the suite tests our
# Triton kernels, and tests/test_sdpa.py turns the dispatch back on where it tests it.
os.environ["DMATTN_DENSE_SDPA"] = "0"

from dmattn_ops.executors import _alloc


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


@pytest.fixture
def kernel_options():
    """use(**options): the rest of the test runs inside dmattn_ops.kernel_options(**options)
    (forcing a route, a config, packing, a split), left when the test ends."""
    import contextlib

    import dmattn_ops

    with contextlib.ExitStack() as stack:
        yield lambda **options: stack.enter_context(dmattn_ops.kernel_options(**options))
