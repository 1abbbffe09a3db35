"""Input builders and error bounds shared by the tests.

Bounds (the project's testing standard): a low-precision result passes when its error against the float64 oracle
is at most twice the error of the same computation done by PyTorch in that precision
(`reference.attention` on the low-precision inputs), plus a rounding term of the output dtype.
NaN never passes: every comparison first checks that the pattern of non-finite values matches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from dmattn_ops import reference
from dmattn_ops.dispatch import launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Our Triton kernels run: compiled on a GPU, in Triton's interpreter on CPU (conftest sets it).
TRITON = DEVICE == "cuda" or launch.interpreter_on()
# float64 results against the float64 oracle: 64 ulps of the largest value.
F64 = 64 * torch.finfo(torch.float64).eps

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# For float64 inputs the ops keep lse (and its remainder) in float64 and backward recomputes
# P = exp((s - lse) - lse_rem): the gradients carry a relative error of about |lse| * 2^-53 per
# term from that recomputation (a few such terms add up), as plain float64 autograd does.
LSE_ROUNDING = 2.0**-53


@dataclass(frozen=True)
class Case:
    b: int
    lq: int
    lk: int
    h: int
    hkv: int
    d: int
    dv: int

    @property
    def id(self) -> str:
        return f"B{self.b}-Lq{self.lq}-Lk{self.lk}-H{self.h}-Hkv{self.hkv}-D{self.d}-Dv{self.dv}"


def param(case: Case, *marks):
    return pytest.param(case, id=case.id, marks=marks)


# Every broadcast pattern of a mask or bias: batch (B|1) x head (H|Hkv|1) x query (Lq|1).
PATTERNS = ["".join(p) for p in itertools.product(("B", "b"), ("H", "G", "h"), ("Q", "q"))]


def operand_shape(pattern: str, c: Case) -> tuple[int, int, int, int]:
    """'BHQ' is (B, H, Lq, Lk); lower case b/h/q means 1; G is the KV-group head dim Hkv."""
    batch = c.b if pattern[0] == "B" else 1
    head = {"H": c.h, "G": c.hkv, "h": 1}[pattern[1]]
    rows = c.lq if pattern[2] == "Q" else 1
    return (batch, head, rows, c.lk)


def make_qkv(c: Case, dtype=torch.float64, device="cpu", requires_grad=False):
    q = torch.randn(c.b, c.lq, c.h, c.d, dtype=dtype, device=device)
    k = torch.randn(c.b, c.lk, c.hkv, c.d, dtype=dtype, device=device)
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def make_mask(shape, density=0.6, device="cpu") -> torch.Tensor:
    return torch.rand(shape, device=device) < density


def make_bias(shape, dtype=torch.float64, device="cpu", requires_grad=False) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)


def assert_finite_like(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    assert not torch.isnan(actual).any(), f"{name}: NaN in result"
    same = (actual.isfinite() == expected.isfinite()) & (actual.isfinite() | (actual == expected))
    assert same.all(), f"{name}: non-finite entries differ from the oracle's"


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = b.isfinite()
    if not fin.any():
        return 0.0
    return (a.double()[fin] - b.double()[fin]).abs().max().item()


def assert_close(actual, expected, atol: float, name: str) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert_finite_like(actual, expected, name)
    err = max_err(actual, expected)
    assert err <= atol, f"{name}: max error {err:.3e} exceeds bound {atol:.3e}"


def rounding(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Error of merely storing the float64 oracle in dtype."""
    fin = ref.isfinite()
    if not fin.any():
        return 0.0
    r = ref[fin]
    return (r.to(dtype).double() - r).abs().max().item()


# All kernels compute in fp32, in an order and formulation that differ from PyTorch's (exp as
# exp2 of log2(e)-scaled differences, delta = rowsum(dO * O) instead of rowsum(P * dP)). Each
# adds a rounding PyTorch's fp32 path does not make; we allow 8 fp32 ulps of the largest
# reference value for them. For bf16/fp16 this is far below the 2x term.
COMPUTE_ULPS = 8


def low_precision_bound(ref64, ref_lowp, dtype) -> float:
    fin = ref64[ref64.isfinite()]
    scale = fin.abs().max().item() if fin.numel() else 0.0
    compute = COMPUTE_ULPS * torch.finfo(torch.float32).eps * scale
    return 2 * max_err(ref_lowp, ref64) + 2 * rounding(ref64, dtype) + compute


def float64_grad_bound(ref_grad: torch.Tensor, lse_ref: torch.Tensor) -> float:
    finite = lse_ref[lse_ref.isfinite()]
    lse_max = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    g_max = max(1.0, ref_grad.abs().max().item()) if ref_grad.numel() else 1.0
    return 16 * LSE_ROUNDING * lse_max * g_max


def assert_grads_close(names, grads, ref_grads, ref_lp_grads, ref_lse, dtype) -> None:
    """Each gradient against the float64 oracle's: float64 within float64_grad_bound, lower
    precisions within low_precision_bound of PyTorch's own error in that precision
    (ref_lp_grads: the oracle run in `dtype`)."""
    for name, g, w, wl in zip(names, grads, ref_grads, ref_lp_grads):
        if dtype == torch.float64:
            assert_close(g, w, float64_grad_bound(w, ref_lse), name)
        else:
            assert_close(g, w, low_precision_bound(w, wl, dtype), name)


def reference_grads(inputs, kwargs, grad_out, mask=None):
    """Float64 oracle output, lse and gradients of <out, grad_out> w.r.t. the inputs given."""
    q, k, v, bias = inputs
    out, lse = reference.attention(q, k, v, mask, bias, return_lse=True, **kwargs)
    wrt = [t for t in inputs if t is not None and t.requires_grad]
    grads = torch.autograd.grad((out * grad_out).sum(), wrt, allow_unused=True)
    return out, lse, grads


def compile_for_gpu(kernel, values: dict, types: dict, cc: int, num_warps: int = 4,
                    default: str = "i32"):  # fmt: skip
    """Compile a @triton.jit kernel for CUDA compute capability `cc` on any machine (no GPU;
    run where TRITON_INTERPRET is off, as the compile tests' subprocesses are): `values` are
    its constexprs (None for an absent operand), `types` the Triton types of other arguments
    by name ("*bf16", "i64"), `default` the type of the rest."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in values:
            signature[name] = "constexpr"
            constexprs[(i,)] = values[name]
        else:
            signature[name] = types.get(name, default)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=num_warps))


def aot_graphs(graphs: list):
    """A torch.compile backend that keeps AOTAutograd's forward and backward graphs in
    `graphs` and runs them without Inductor (what our ops trace into is then visible),
    partitioned by Inductor's own partitioner, as Inductor's graphs are."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    def keep(g, _):
        graphs.append(g)
        return make_boxed_func(g)

    return lambda gm, example_inputs: aot_module_simplified(
        gm,
        example_inputs,
        fw_compiler=keep,
        bw_compiler=keep,
        partition_fn=min_cut_rematerialization_partition,
    )


def dmattn_nodes(graphs) -> list[str]:
    """The dmattn ops left whole in `graphs` (none where compiled graphs trace our kernels)."""
    return [str(n.target) for g in graphs for n in g.graph.nodes if "dmattn" in str(n.target)]
