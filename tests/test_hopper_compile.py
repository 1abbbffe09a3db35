"""The Gluon kernels (kernels/hopper.py) compile for sm_90 with the Triton installed here, without
a GPU, through the executor's own launchers (dmattn_ops/executors/hopper.py): its descriptors,
arguments and tiles, the kernel launch replaced by a compile for an H100/H200 target.

The GPU runs only ever see the device machine's Triton (3.6), while users install the newest:
a later Triton renamed the TMA load (async_copy_global_to_shared, which now raises, to
async_load), and nothing but a compile with the newer Triton shows such a break (it made every
long key-list call on an H100 fail under the newest torch). The compile runs in a subprocess
without TRITON_INTERPRET (tests/conftest.py turns the interpreter on in this process, and
interpreted kernels cannot be compiled).

The compile also checks what Triton's frontend carries through each loop. It carries a name only
where the IR value the loop body leaves in it differs from the one it held before the loop
(`CodeGenerator._find_carries`), so a name the body rebinds to that same value, as in
`b = nxt` inside a loop where `b = nxt` also held before it, keeps its first value in every
iteration: a silent miscompile, found as a hang on the GPU (bench/NOTES.md 261). Every name a
loop body assigns that is live into the loop must be carried.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.experimental.gluon")

# sm_90's shared memory per block (test_hopper_fit.py's limit).
SM90_SHARED = 232_448

# (dtype, bias dtype or None, causal, Lk, dK/dV split, dbias): the forward's two tile sizes
# (Lk below and at LONG_TILES_MIN_LK), a float32 bias (fewer stages), no bias, the split's
# float32 parts, the per-key-column bias gradient.
CASES = {
    "bf16-bias-causal": ("bfloat16", "bfloat16", True, 16384, 1, False),
    "fp16-nobias-long-split": ("float16", None, False, 32768, 2, False),
    "bf16-f32bias-dbias": ("bfloat16", "float32", True, 16384, 1, True),
}

# The case compiled even where Triton's cache holds its kernels, for the loop-carry check (the
# others check what they compile; their loops are the same code under other constants).
CARRY_CHECKED = "bf16-bias-causal"

COMPILE = r"""
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

from dmattn_ops.executors import hopper as hx

TARGET = GPUTarget("cuda", 90, 128)
compiled = []
uncarried = []  # (function, line in it, name): assigned in a loop body, live into it, not carried

try:
    from triton.compiler import code_generator as cg
    find_carries = cg.CodeGenerator._find_carries  # Triton 3.4 onwards
except (ImportError, AttributeError):
    cg = None
if cg is not None:
    visit_body = cg.CodeGenerator.visit_compound_statement
    defined = {}  # id(statements) -> the names their last visit defined

    def visit_and_note(self, stmts):
        result = visit_body(self, stmts)
        defined[id(stmts)] = set(self.local_defs)
        return result

    def find_and_check(self, node, liveins, ignore=frozenset()):
        names, handles, tys = find_carries(self, node, liveins, ignore)
        for name in defined.pop(id(node.body), ()):  # set by the dry visit just made
            if name in liveins and name not in ignore and name not in names:
                uncarried.append([self.jit_fn.__name__, node.lineno, name])
        return names, handles, tys

    cg.CodeGenerator.visit_compound_statement = visit_and_note
    cg.CodeGenerator._find_carries = find_and_check


class CompileInstead:
    "kernel[grid](*args, **kwargs) compiling the launch for sm_90 instead of running it"

    def __init__(self, lazy):
        self.lazy = lazy

    def __getitem__(self, grid):
        fn = self.lazy.fn

        def launch(*args, **kwargs):
            backend = make_backend(TARGET)
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, spec, options = binder(*args, **kwargs)
            options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
            k = triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=TARGET,
                               options=options.__dict__)
            compiled.append([fn.__name__, k.metadata.shared])

        return launch


for name in ("_FORWARD_KERNEL", "_DQ_KERNEL", "_DKDV_KERNEL"):
    setattr(hx, name, CompileInstead(getattr(hx, name)))
dtype, bias_dtype, causal, lk, split, dbias = json.loads(sys.argv[1])
dtype = getattr(torch, dtype)
b, h, hkv, d = 1, 4, 2, 128
q = torch.zeros(b, lk, h, d, dtype=dtype)
k = torch.zeros(b, lk, hkv, d, dtype=dtype)
bias = None if bias_dtype is None else torch.zeros(b, hkv, 1, lk, dtype=getattr(torch, bias_dtype))
keys = torch.zeros(b, hkv, lk, dtype=torch.int32)
key_end = torch.zeros(b, hkv, lk // hx.BLOCK_M, dtype=torch.int32)
key_count = torch.zeros(b, hkv, dtype=torch.int32)
out, stats = torch.zeros_like(q), torch.zeros(b, h, lk, 4)
lse, lse_rem = torch.zeros(b, h, lk), torch.zeros(b, h, lk)
hx._hopper_forward(q, k, k, bias, keys, key_end, key_count, out, lse, lse_rem, 0.1, causal, 2)
hx._hopper_dq(q, k, k, q, out, lse, lse_rem, bias, keys, key_end, key_count, torch.zeros_like(q),
              stats, 0.1, causal, 2)
g = h // hkv
parts = [torch.zeros(split, b * hkv, lk, d) for _ in range(2)] if split > 1 else [None, None]
part_db = torch.zeros(split, b * hkv, lk) if split > 1 and dbias else None
hx._hopper_dkdv(q, k, k, q, stats, bias, keys, key_count, torch.zeros_like(k), torch.zeros_like(k),
                torch.zeros(b, hkv, 1, lk, dtype=dtype) if dbias else None, *parts, part_db, 0.1,
                causal, 2, split)
print(json.dumps({"compiled": compiled, "uncarried": uncarried}))
"""


@pytest.mark.parametrize("case", list(CASES))
def test_gluon_kernels_compile_for_sm90(case):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if case == CARRY_CHECKED:  # a cached kernel would skip the frontend and its check
        env["TRITON_ALWAYS_COMPILE"] = "1"
    res = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(CASES[case])], capture_output=True, text=True,
        env=env, cwd=os.path.dirname(__file__), timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    compiled = result["compiled"]
    assert not result["uncarried"], f"loop-carried names Triton dropped: {result['uncarried']}"
    assert [name for name, _ in compiled] == ["hopper_fwd_kernel", "hopper_dq_kernel",
                                              "hopper_dkdv_kernel"]  # fmt: skip
    for name, shared in compiled:
        assert 0 < shared <= SM90_SHARED, (name, shared)
