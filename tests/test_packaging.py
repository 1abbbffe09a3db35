"""Installation layout and the main job."""

import os
import subprocess
import sys

import pytest


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


@pytest.mark.slow
def test_main_job(tmp_path):
    res = run_python(["-m", "dmattn_ops"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all checks passed" in res.stdout
