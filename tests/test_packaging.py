"""Installation layout and the main job."""

import os
import subprocess
import sys

import pytest
import torch


def run_python(code_or_args, cwd):
    args = [sys.executable, *code_or_args]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def test_kernels_is_a_subpackage_and_never_top_level(tmp_path):
    res = run_python(["-c", "import dmattn_ops.kernels as k; print(k.__name__)"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "dmattn_ops.kernels"
    res = run_python(["-c", "import kernels"], tmp_path)
    assert res.returncode != 0 and "No module named 'kernels'" in res.stderr


def test_a_misnamed_kernel_names_itself(monkeypatch):
    """A LazyKernel whose kernel does not exist raises a LookupError naming it at first use (the
    missing attribute, raised inside a property, used to recurse through __getattr__)."""
    from dmattn_ops.executors._triton import LazyKernel

    def load():
        from dmattn_ops.kernels import attention_bwd_dq

        return (attention_bwd_dq,)

    kernel = LazyKernel(load, "no_such_kernel")
    with pytest.raises(LookupError, match="no_such_kernel"):
        kernel[(1,)]
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the launch cache's path (GPU launches)
    with pytest.raises(LookupError, match="no_such_kernel"):
        kernel[(1,)]
    with pytest.raises(LookupError, match="no_such_kernel"):
        _ = kernel.arg_names


@pytest.mark.sweep
def test_main_job(tmp_path):
    res = run_python(["-m", "dmattn_ops"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all checks passed" in res.stdout
    if torch.cuda.is_available():  # the speed line, ours against SDPA on one DMA shape
        assert "speed, B" in res.stdout and "SDPA dense" in res.stdout, res.stdout


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # as where Triton does not install: any import of it fails
import torch
import dmattn_ops
from dmattn_ops import masks, reference
assert "triton" not in [m for m in sys.modules if sys.modules[m] is not None]
q, k, v = torch.randn(1, 9, 4, 16), torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16)
bias = torch.randn(1, 2, 1, 9, requires_grad=True)
mask = masks.topk_mask(bias.detach(), 4)
out = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True)
want = reference.attention(q, k, v, mask, bias, is_causal=True)
assert (out - want).abs().max() < 1e-5
out.sum().backward()
assert bias.grad is not None and torch.isfinite(bias.grad).all()
try:
    dmattn_ops.attention(q, k, v, backend="triton")
except ModuleNotFoundError as e:
    assert "needs the triton package" in str(e) and e.name == "triton", e
else:
    raise AssertionError("backend='triton' ran without Triton")
print("ok without triton")
"""


def test_cpu_paths_work_without_triton(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    res = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok without triton" in res.stdout


def _readme_blocks() -> list[str]:
    path = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
    blocks, current = [], None
    with open(path) as fh:
        lines = fh.read().splitlines()
    for line in lines:
        if line.strip() == "```python":
            current = []
        elif line.strip() == "```" and current is not None:
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


README_BLOCKS = _readme_blocks()


@pytest.mark.parametrize("index", range(len(README_BLOCKS)))
def test_readme_python_blocks_run(index, tmp_path):
    """Every Python block of the README runs as written (the PyTorch path on CPU) and prints
    what it checked, so that a reader trying it sees that it worked."""
    code = README_BLOCKS[index]
    if "transformers" in code:
        pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, f"README block {index}:\n{code}\n{res.stderr[-3000:]}"
    assert res.stdout.strip(), f"README block {index} prints nothing:\n{code}"


def test_readme_has_python_blocks():
    assert len(README_BLOCKS) >= 3


BUILD = """
import sys
from setuptools import build_meta
kind, out = sys.argv[1], sys.argv[2]
print((build_meta.build_sdist if kind == "sdist" else build_meta.build_wheel)(out))
"""


def _build(kind: str, out) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", BUILD, kind, str(out)], cwd=root,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return os.path.join(str(out), res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sdist_and_wheel_contents(tmp_path):
    """Built one after the other (both write the source tree's egg-info): the sdist holds what
    its tests need, the wheel installs the kernels under the package and nothing else."""
    import tarfile
    import zipfile

    with tarfile.open(_build("sdist", tmp_path)) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("LICENSE", "README.md", "pyproject.toml", "tests/conftest.py",
                   "tests/helpers.py", "kernels/attention_fwd.py", "dmattn_ops/py.typed",
                   "bench/__main__.py"):  # fmt: skip
        assert needed in names, f"{needed} missing from the sdist"

    with zipfile.ZipFile(_build("wheel", tmp_path)) as whl:
        names = set(whl.namelist())
    assert "dmattn_ops/kernels/attention_fwd.py" in names
    assert "dmattn_ops/py.typed" in names
    assert not any(n.startswith(("kernels/", "tests/", "bench/")) for n in names)
    assert any(n.endswith("licenses/LICENSE") for n in names)


def test_the_private_torch_names_import_on_this_torch():
    """dmattn_ops.core._compat holds every private name the ops import (CI runs it on the pinned and
    the newest torch through the main job and the torch.func tests)."""
    from dmattn_ops.core import _compat

    for name in _compat.__all__:
        assert getattr(_compat, name) is not None, name


LAYERS = ("core", "executors", "dispatch", "registration")  # bottom up; the public modules last


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return len(LAYERS)  # a public module (api, masks, nn, flex, ...) or the package itself


def test_layers_import_only_downwards():
    """The README's layout: core imports nothing else of the package, executors only core,
    dispatch those two, registration those three; the public modules anything. Every import
    counts, those inside functions too."""
    import ast
    import pathlib

    import dmattn_ops

    root = pathlib.Path(dmattn_ops.__file__).parent
    upward = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("dmattn_ops", *path.relative_to(root).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module == "dmattn_ops":
                names = [f"dmattn_ops.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if not name.startswith("dmattn_ops.") or name.startswith("dmattn_ops.kernels"):
                    continue
                if _layer(name) > _layer(module):
                    upward.append(f"{module} imports {name}")
    assert not upward, "\n".join(sorted(set(upward)))
