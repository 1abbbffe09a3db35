import os

# The GPU check may spread the xdist workers over several GPUs (DMATTN_TEST_GPUS=1,2,3): worker
# gwN sees the N-th of them, modulo their number, as its only GPU. Set before torch starts CUDA.
_gpus, _worker = os.environ.get("DMATTN_TEST_GPUS"), os.environ.get("PYTEST_XDIST_WORKER")
if _gpus and _worker:
    _ids = _gpus.split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _ids[int(_worker.removeprefix("gw")) % len(_ids)]

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter. It is chosen when a kernel is
# decorated, so it must be set before dmattn_ops (and its kernels) are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Dense calls on CUDA would run PyTorch's flash kernels (dmattn_ops/executors/sdpa.py); the suite tests our
# Triton kernels, and tests/test_sdpa.py turns the dispatch back on where it tests it.
os.environ["DMATTN_DENSE_SDPA"] = "0"
# Launch arguments made once per plan (dmattn_ops/executors/_triton.py prepared) are made again
# at every later launch and compared: a plan that does not fix what a launch site claims fails.
os.environ["DMATTN_CHECK_PREPARED"] = "1"

from dmattn_ops.executors import _alloc  # noqa: E402

_DURATIONS = os.environ.get("DMATTN_TEST_DURATIONS")
_XDIST_CONTROLLER = False


def pytest_configure(config):
    global _XDIST_CONTROLLER
    _XDIST_CONTROLLER = bool(getattr(config.option, "numprocesses", None))


def pytest_runtest_logreport(report):
    """With DMATTN_TEST_DURATIONS=path, each test's call phase appends "seconds nodeid" to that
    file as it ends (every xdist worker appends to the one file; xdist's controller, which
    receives the same reports, does not): the slowest tests of a run its time limit cuts,
    which pytest's own --durations, printed at the end, never shows."""
    if _DURATIONS and report.when == "call" and (_worker or not _XDIST_CONTROLLER):
        with open(_DURATIONS, "a") as f:
            f.write(f"{report.duration:.2f} {report.nodeid}\n")


@pytest.fixture(autouse=True)
def poison_library_allocations(monkeypatch):
    """Fill every output the library allocates with NaN: an unwritten element fails loudly."""
    monkeypatch.setattr(_alloc, "POISON", True)


@pytest.fixture(autouse=True)
def fixed_seed():
    torch.manual_seed(0)


# The default run (README command 2) samples the parametrized sweeps: each test function runs
# its first case, every SAMPLE-th after it, and any case bringing a value of a short parameter
# list (a flag, a dtype, a layout) that no case kept before it had, so that every such value
# runs somewhere (a 2-case test whose second case only --sweeps ran hid a broken case for weeks:
# bench/NOTES.md 227). Tests marked `sweep` (the sm_90/sm_80 compile of every config,
# whole-program runs of the tools) wait for the full run. `--sweeps` runs every case (the GPU
# check, .ci/gpu); `--sweeps-only` runs exactly what the default run leaves out, so that the two
# together run each case once.
SAMPLE = 8
FEW_VALUES = 3


def pytest_addoption(parser):
    group = parser.getgroup("dmattn")
    group.addoption(
        "--sweeps", action="store_const", const="all", dest="sweeps", default="sample",
        help="run every case of every sweep (the default runs a sample of each)",
    )  # fmt: skip
    group.addoption(
        "--sweeps-only", action="store_const", const="rest", dest="sweeps",
        help="run only the cases the default run leaves out",
    )  # fmt: skip


def _sampled(items) -> set:
    """The items of the default run: unmarked, and of a parametrized function its first case,
    every SAMPLE-th after it, and each case with a value of a parameter of at most FEW_VALUES
    values (a flag, a dtype, a layout; by its index in the parametrize list) that no kept case
    of the function had. Longer lists (shapes, patterns) stay sampled. In collection order, the
    same in every xdist worker."""
    counts: dict = {}  # (function, parameter) -> the value indices its cases take
    for item in items:
        if hasattr(item, "callspec"):
            for name, i in item.callspec.indices.items():
                counts.setdefault(((item.path, item.originalname), name), set()).add(i)
    few = {k: len(v) <= FEW_VALUES for k, v in counts.items()}
    seen: dict = {}
    covered: dict = {}
    kept = set()
    for item in items:
        if "sweep" in item.keywords:
            continue
        if not hasattr(item, "callspec"):
            kept.add(item.nodeid)
            continue
        key = (item.path, item.originalname)
        index = seen[key] = seen.get(key, -1) + 1
        values = {(name, i) for name, i in item.callspec.indices.items() if few[key, name]}
        done = covered.setdefault(key, set())
        if index % SAMPLE == 0 or not values <= done:
            kept.add(item.nodeid)
            done |= values
    return kept


def pytest_collection_modifyitems(config, items):
    mode = config.getoption("sweeps")
    if mode != "all":
        sample = _sampled(items)
        keep = [i for i in items if (i.nodeid in sample) == (mode == "sample")]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    if torch.cuda.is_available():
        _longest_first(items)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_GPU_DURATIONS = os.path.join(os.path.dirname(__file__), "gpu_durations.txt")


def _longest_first(items):
    """On a CUDA machine the tests of gpu_durations.txt (a GPU run's slowest) go first, longest
    first, the rest after them in collection order: xdist hands tests out in this order, so a
    5-minute test no longer starts in the last minutes of a run a time limit cuts."""
    seconds = {}
    with open(_GPU_DURATIONS) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                value, nodeid = line.split(maxsplit=1)
                seconds[nodeid.strip()] = float(value)
    items.sort(key=lambda item: -seconds.get(item.nodeid, 0.0))


@pytest.fixture
def kernel_options():
    """use(**options): the rest of the test runs inside dmattn_ops.kernel_options(**options)
    (forcing a route, a config, packing, a split), left when the test ends."""
    import contextlib

    import dmattn_ops

    with contextlib.ExitStack() as stack:
        yield lambda **options: stack.enter_context(dmattn_ops.kernel_options(**options))
