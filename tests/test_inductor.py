"""Compiled graphs launch our kernels themselves (dmattn_ops/registration/inductor.py): under torch.compile
the kernel-carrying ops are replaced by their launchers' bodies, traced, so Inductor compiles and
launches the Triton kernels; eager calls, export and CPU graphs keep the ops whole.

On CPU the mechanism is checked through the chunked PyTorch path (float64), with the CUDA
condition lifted; on a GPU the Triton kernels run from Inductor's generated code and must give
exactly the eager results."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import (
    DEVICE,
    Case,
    aot_graphs,
    assert_close,
    dmattn_nodes,
    low_precision_bound,
    make_bias,
    make_mask,
    make_qkv,
)

import dmattn_ops
from dmattn_ops import reference
from dmattn_ops.masks import select_topk, topk_mask
from dmattn_ops.registration import inductor, static_launch

gpu = pytest.mark.gpu


@pytest.fixture
def inductor_kernels(monkeypatch):
    monkeypatch.setenv("DMATTN_INDUCTOR_KERNELS", "1")


def _graphs_of(fn, *args):
    """Runs fn through aot_autograd (forward and backward graphs kept) and returns its output
    and the graphs."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    return aot_function(fn, keep, keep)(*args), graphs


def _attention_loss(q, k, v, bias, mask):
    out = torch.ops.dmattn.attention(q, k, v, mask, bias, None, True)
    return out.square().sum()


def _cpu_inputs():
    c = Case(2, 24, 40, 4, 2, 16, 16)
    q, k, v = make_qkv(c, requires_grad=True)
    bias = make_bias((c.b, c.hkv, 1, c.lk), requires_grad=True)
    mask = make_mask((c.b, c.hkv, 1, c.lk))
    return q, k, v, bias, mask


def test_traced_graphs_hold_the_launchers_not_the_ops(monkeypatch):
    monkeypatch.setattr(inductor, "applies", lambda first: inductor._traced())
    q, k, v, bias, mask = _cpu_inputs()
    loss, graphs = _graphs_of(_attention_loss, q, k, v, bias, mask)
    grads = torch.autograd.grad(loss, (q, k, v, bias))
    assert len(graphs) == 2 and dmattn_nodes(graphs) == []  # forward and backward graphs
    ref_inputs = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    ref_loss = reference.attention(*ref_inputs[:3], mask, ref_inputs[3], is_causal=True)
    ref_grads = torch.autograd.grad(ref_loss.square().sum(), ref_inputs)
    torch.testing.assert_close(loss, ref_loss.square().sum())
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def _call_targets(graphs) -> list[str]:
    """The targets of `graphs`' call_function nodes, as strings."""
    return [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]


def _kernel_nodes(graphs) -> int:
    """The user Triton kernels launched in `graphs` (torch.library.wrap_triton's nodes)."""
    return sum("triton_kernel_wrapper" in t for t in _call_targets(graphs))


def test_calls_that_want_no_gradient_are_traced_too(monkeypatch):
    """An inference or decode call (no input requires grad) reaches the public op below
    autograd; its graph traces the op's body as a training call's does, instead of keeping
    dmattn::attention whole (whose launcher would run at every call). On the CPU the body is
    the chunked path's (float64, module doc)."""
    monkeypatch.setattr(inductor, "applies", lambda first: inductor._traced())
    q, k, v, bias, mask = (t.detach() for t in _cpu_inputs())

    def fn(q, k, v, mask, bias):
        return dmattn_ops.attention(q, k, v, mask, bias, is_causal=True)

    got, graphs = _graphs_of(fn, q, k, v, mask, bias)
    assert len(graphs) == 1 and dmattn_nodes(graphs) == []
    torch.testing.assert_close(got, fn(q, k, v, mask, bias), rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_calls_that_want_no_gradient_trace_the_kernels(inductor_kernels, layout):
    """The same on the GPU, where the traced body launches the forward's Triton kernels, for
    packed sequences too. (On the CPU a varlen call's body is the chunked path, which reads
    cu_seqlens on the host and cannot be traced on fake tensors: such calls keep the op whole,
    inductor.applies. The Triton interpreter cannot run on fake tensors either.)"""
    c = Case(2, 24, 24, 4, 2, 16, 16)
    q, k, v = make_qkv(c, dtype=torch.float32, device="cuda")
    bias = make_bias((c.b, c.hkv, 1, c.lk), dtype=torch.float32, device="cuda")
    if layout == "dense":
        mask = make_mask((c.b, c.hkv, 1, c.lk), device="cuda")
        args = (q, k, v, mask, bias)

        def fn(q, k, v, mask, bias):
            return dmattn_ops.attention(q, k, v, mask, bias, is_causal=True)

    else:
        cu = torch.tensor([0, c.lq, 2 * c.lq], dtype=torch.int32, device="cuda")
        bias = bias.transpose(0, 1).reshape(c.hkv, -1)  # (Hkv, total keys)
        args = (*(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), cu, bias)

        def fn(q, k, v, cu, bias):
            return dmattn_ops.attention_varlen(
                q, k, v, cu, cu, c.lq, c.lq, None, bias, is_causal=True
            )

    got, graphs = _graphs_of(fn, *args)  # aot_function fakes the arguments, not what fn holds
    assert len(graphs) == 1 and dmattn_nodes(graphs) == [] and _kernel_nodes(graphs) >= 1
    torch.testing.assert_close(got, fn(*args), rtol=0, atol=0)


@gpu
def test_traced_topk_writes_bytes_and_compares(inductor_kernels):
    """topk_select is traced like the attention ops; its graph reads the kernel's bytes through
    `!= 0` (inductor.py: Inductor would inline a bool buffer from torch.empty that only a user
    kernel writes as False where FlexAttention's mask_mod captures it). Triton's interpreter
    cannot run on fake tensors, so this needs the GPU."""
    bias = make_bias((2, 3, 1, 50), dtype=torch.float32, device="cuda")
    allowed = make_mask((2, 1, 1, 50), 0.8, "cuda")
    got, graphs = _graphs_of(lambda b, m: topk_mask(b, 12, m), bias, allowed)
    assert dmattn_nodes(graphs) == []
    targets = _call_targets(graphs)
    assert any("triton_kernel_wrapper" in t for t in targets)
    assert "aten.ne.Scalar" in targets
    assert got.dtype == torch.bool and torch.equal(got, topk_mask(bias, 12, allowed))

    # The case that came out all False: the traced mask captured by FlexAttention's mask_mod.
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 40, h, 32, device="cuda") for h in (6, 3, 3))
    mask_bias = torch.randn(2, 3, 1, 40, device="cuda")

    def f(q, k, v, b):
        return dmattn_ops.attention(q, k, v, topk_mask(b, 9), b, backend="flex", is_causal=True)

    mask = topk_mask(mask_bias, 9)
    want = reference.attention(
        *(t.double() for t in (q, k, v)), mask, mask_bias.double(), is_causal=True
    )
    fp32 = reference.attention(q, k, v, mask, mask_bias, is_causal=True)
    got = torch.compile(f, fullgraph=True)(q, k, v, mask_bias)
    assert_close(got.double(), want, low_precision_bound(want, fp32, torch.float32), "flex")


@gpu
def test_traced_topk_of_long_rows_reads_them_in_chunks(inductor_kernels, monkeypatch):
    """Rows past masks.FUSED_MAX_KEYS take the kernel's chunked path (the CHUNKED constexpr
    passes through the traced launch), here with 16-key chunks over rows of 50 keys, masked,
    smoothed and not; the traced graph's mask equals the eager call's."""
    from dmattn_ops import masks

    monkeypatch.setattr(masks, "FUSED_MAX_KEYS", 16)
    monkeypatch.setattr(masks, "ROW_CHUNK", 16)
    bias = make_bias((2, 3, 1, 50), dtype=torch.bfloat16, device="cuda")
    allowed = make_mask((2, 1, 1, 50), 0.8, "cuda")
    for block_size in (None, 8):
        torch._dynamo.reset()
        fn = lambda b, m, s=block_size: topk_mask(b, 12, m, block_size=s)
        got, graphs = _graphs_of(fn, bias, allowed)
        targets = _call_targets(graphs)
        assert any("triton_kernel_wrapper" in t for t in targets)
        assert torch.equal(got, fn(bias, allowed)), block_size  # eager: tests/test_masks.py


@gpu
def test_layer_passes_the_selection_buffer_on(inductor_kernels):
    """DynamicMaskAttention's own mask goes to our ops alone, so its compiled graph reads the
    selection kernel's bool buffer without the `!= 0` launch (masks.select_topk(direct=True)),
    with the same selection and the same attention as the eager layer; the flex layer keeps
    the comparison (its mask_mod captures the mask)."""
    from dmattn_ops.nn import DynamicMaskAttention

    torch.manual_seed(0)
    bias = make_bias((2, 3, 1, 50), dtype=torch.float32, device="cuda")
    got, graphs = _graphs_of(lambda b: select_topk(b, 12, direct=True), bias)
    targets = _call_targets(graphs)
    assert any("triton_kernel_wrapper" in t for t in targets)
    assert "aten.ne.Scalar" not in targets
    assert got.dtype == torch.bool and torch.equal(got, topk_mask(bias, 12))

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def make(backend):
        torch.manual_seed(0)
        return DynamicMaskAttention(64, 4, 2, window=9, is_causal=True, backend=backend)

    x = torch.randn(2, 40, 64, device="cuda")
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    for backend, compares in (("triton", False), ("flex", True)):
        graphs.clear()
        torch._dynamo.reset()
        compiler = aot_autograd(fw_compiler=keep)
        torch.compile(make(backend).cuda(), backend=compiler, fullgraph=True)(x)
        targets = _call_targets(graphs)
        assert any("triton_kernel_wrapper" in t for t in targets), backend
        assert ("aten.ne.Scalar" in targets) == compares, backend
    # Through Inductor, within fp32's own error of the float64 oracle layer.
    torch._dynamo.reset()
    got = torch.compile(make("triton").cuda(), fullgraph=True)(x)
    want = make("reference").cuda().double()(x.double())
    fp32 = make("reference").cuda()(x)
    assert_close(got.double(), want, low_precision_bound(want, fp32, torch.float32), "layer")


def test_cpu_graphs_keep_the_ops():
    q, k, v, bias, mask = _cpu_inputs()
    loss, graphs = _graphs_of(_attention_loss, q, k, v, bias, mask)
    loss.backward()
    assert "dmattn.attention_forward.default" in dmattn_nodes(graphs)
    assert "dmattn.attention_backward.default" in dmattn_nodes(graphs)


def test_on_by_default(monkeypatch):
    monkeypatch.delenv("DMATTN_INDUCTOR_KERNELS", raising=False)
    assert inductor.enabled()


def _python(code: str, var: str, value: str | None) -> str:
    """stdout of `python -c code` in a fresh process, with environment variable `var` set to
    value (None: unset)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != var}
    if value is not None:
        env[var] = value
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


def test_import_changes_no_setting():
    """SPEC: `import dmattn_ops` leaves PyTorch's settings and the environment as they were
    (the static launcher is turned on by the first trace of our ops, static_launch.py)."""
    code = (
        "import os, torch, torch._inductor.config as c, torch.backends.cuda as b; "
        "env = dict(os.environ); before = (c.save_config(), b.flash_sdp_enabled(), "
        "torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision()); "
        "import dmattn_ops; "
        "after = (c.save_config(), b.flash_sdp_enabled(), "
        "torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision()); "
        "print(before == after, env == dict(os.environ))"
    )
    assert _python(code, "DMATTN_NOTHING", None) == "True True"


def test_first_trace_turns_the_static_launcher_on_unless_the_user_chose():
    """In fresh processes: launch_statically (what our fake kernels and trace rules call on
    CUDA) turns the option on, in the environment too, so a process started after it (as
    Inductor's compile workers are) has it on; a choice made before, in code or in the
    environment, stands."""
    name, var = static_launch.OPTION, static_launch.VARIABLE
    call = (
        "from dmattn_ops.registration.static_launch import launch_statically; launch_statically(); "
    )
    read = f"import torch._inductor.config as c; print(c.{name})"
    spawn = (
        "import subprocess, sys; import dmattn_ops; import torch._inductor.config as c; "
        f"first = c.{name}; {call}"
        f"w = subprocess.run([sys.executable, '-c', {read!r}], capture_output=True, text=True); "
        f"print(first, c.{name}, w.stdout.strip())"
    )
    assert _python(spawn, var, None) == "False True True"
    in_code = f"import torch._inductor.config as c; c.{name} = False; import dmattn_ops, os; {call}"
    assert _python(in_code + f"print(c.{name}, os.environ.get({var!r}))", var, None) == "False None"
    assert _python(f"import dmattn_ops; {call}{read}", var, "0") == "False"


def test_turning_the_static_launcher_on_restarts_running_compile_workers():
    """Compile workers started before our first trace (a model without our ops compiled
    first) never read the option: they are shut down when it turns on, so that Inductor's
    next pool starts with it in its environment (static_launch.py). A pool the user's choice
    leaves alone (the variable set) is not touched."""
    code = (
        "import dmattn_ops, torch._inductor.async_compile as a\n"
        "from dmattn_ops.registration.static_launch import launch_statically\n"
        "class Pool:\n"
        "    down = 0\n"
        "    def shutdown(self): Pool.down += 1\n"
        "a._pool_set.add(Pool()); launch_statically(); launch_statically()\n"
        "print(Pool.down, len(a._pool_set))"
    )
    assert _python(code, static_launch.VARIABLE, None) == "1 0"
    assert _python(code, static_launch.VARIABLE, "1") == "0 1"


def test_switch_keeps_the_ops(monkeypatch):
    monkeypatch.setenv("DMATTN_INDUCTOR_KERNELS", "0")
    monkeypatch.setattr(
        inductor, "applies", lambda first: inductor.enabled() and inductor._traced()
    )
    q, k, v, bias, mask = _cpu_inputs()
    _, graphs = _graphs_of(_attention_loss, q, k, v, bias, mask)
    assert "dmattn.attention_forward.default" in dmattn_nodes(graphs)


def test_only_traces_consult_the_rules(monkeypatch):
    asked = []
    real = inductor.applies
    monkeypatch.setattr(inductor, "applies", lambda first: asked.append(1) or real(first))
    q, k, v, bias, mask = _cpu_inputs()
    _attention_loss(q, k, v, bias, mask).backward()
    assert asked == []  # eager: no FunctionalTensorMode, the rules are never asked
    loss, _ = _graphs_of(_attention_loss, q, k, v, bias, mask)
    loss.backward()
    assert len(asked) >= 2  # the forward and the backward op, each traced once


# On the GPU: Inductor compiles and launches our kernels.


def _gpu_case(kind: str):
    c = Case(2, 300, 300, 8, 2, 64, 64)
    q, k, v = (t.cuda().bfloat16() for t in make_qkv(c))
    mask = bias = None
    if kind in ("keys", "keys-heads", "tables"):
        bias = make_bias((c.b, c.hkv, 1, c.lk), device="cuda").bfloat16()
        mask = (
            make_mask((c.b, 1, c.lq, c.lk), 0.3, "cuda")
            if kind == "tables"
            else topk_mask(bias, 96)
        )
    return q, k, v, mask, bias


@gpu
@pytest.mark.parametrize("kind", ["dense", "keys", "keys-heads", "tables"])
def test_compiled_kernels_match_eager_exactly(kind, monkeypatch, inductor_kernels, kernel_options):
    """keys-heads: the key lists' forward and dq kernels with a KV group's query heads per
    program (plan._pack_heads), which long calls take, at this short length."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("DMATTN_DENSE_SDPA", "0")
    if kind == "keys-heads":
        kernel_options(pack_heads=True)
    torch._dynamo.reset()
    q, k, v, mask, bias = _gpu_case(kind)

    # A bf16 cotangent seen as float32: the gradient reaching our backward kernels is exactly
    # it in both runs, so any difference would come from the kernels' launches.
    g = torch.randn(q.shape[:3] + (v.shape[-1],), device="cuda").bfloat16().float()

    def loss(q, k, v, bias):
        out = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True)
        return out, (out.float() * g).sum()

    def step(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, bias) if t is not None]
        out, value = fn(*leaves, *([None] if bias is None else []))
        value.backward()
        return out.detach(), [t.grad for t in leaves]

    eager = step(loss)
    result, code = run_and_get_code(step, torch.compile(loss, fullgraph=True))
    source = "\n".join(code)
    assert "attention_fwd_kernel" in source and "attention_bwd_dq_kernel" in source
    assert "torch.ops.dmattn" not in source
    torch.testing.assert_close(result[0], eager[0], rtol=0, atol=0)
    for grad, e in zip(result[1][:3], eager[1][:3]):  # dq, dk, dv: straight from our kernels
        torch.testing.assert_close(grad, e, rtol=0, atol=0)
    if bias is not None:
        # dbias sums the G query heads' float32 columns (launch._sum_to_bias), which Inductor
        # may reduce in another order: at most one bfloat16 rounding step apart.
        grad, e = result[1][3].float(), eager[1][3].float()
        assert ((grad - e).abs() <= e.abs() * 2.0**-7).all()


@gpu
def test_compiled_topk_mask_and_varlen_match_eager(inductor_kernels):
    torch._dynamo.reset()
    bias = torch.randn(2, 4, 1, 512, device="cuda")
    compiled = torch.compile(lambda b: topk_mask(b, 100), fullgraph=True)
    assert torch.equal(compiled(bias), topk_mask(bias, 100))

    cu = torch.tensor([0, 100, 356], dtype=torch.int32, device="cuda")
    q = torch.randn(356, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(356, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(356, 2, 64, device="cuda", dtype=torch.bfloat16)
    kbias = torch.randn(2, 356, device="cuda", dtype=torch.bfloat16)
    kmask = torch.rand(2, 356, device="cuda") < 0.5

    def f(q, k, v):
        return dmattn_ops.attention_varlen(q, k, v, cu, cu, 256, 256, kmask, kbias, is_causal=True)

    torch.testing.assert_close(
        torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v), rtol=0, atol=0
    )


@gpu
def test_export_keeps_the_op_on_cuda(inductor_kernels):
    q, k, v, mask, bias = _gpu_case("keys")

    class M(torch.nn.Module):
        def forward(self, q, k, v, mask, bias):
            return torch.ops.dmattn.attention(q, k, v, mask, bias, None, True)

    ep = torch.export.export(M(), (q, k, v, mask, bias))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "dmattn.attention.default" in targets


def test_traced_seqused_k_skips_the_value_check(monkeypatch):
    """seqused_k's range check reads the tensor; inside the traced body it is fake and skipped."""
    monkeypatch.setattr(inductor, "applies", lambda first: inductor._traced())
    q, k, v, bias, mask = _cpu_inputs()
    seqused = torch.tensor([40, 17], dtype=torch.int32)

    def f(q, k, v, bias, mask, seqused):
        return torch.ops.dmattn.attention(q, k, v, mask, bias, None, True, 0.0, seqused)

    out, graphs = _graphs_of(f, q, k, v, bias, mask, seqused)
    assert dmattn_nodes(graphs) == []
    want = reference.attention(q, k, v, mask, bias, is_causal=True, seqused_k=seqused)
    torch.testing.assert_close(out, want)


def test_symbolic_sizes_switched_off_keep_the_ops(monkeypatch):
    """DMATTN_SYMBOLIC_KERNELS=0: a graph with symbolic sizes keeps the ops whole (one node
    each, the launchers run at each call), compiles once for every size, and computes the
    same."""
    monkeypatch.setattr(inductor, "applies", lambda first: inductor._traced())
    monkeypatch.setenv("DMATTN_SYMBOLIC_KERNELS", "0")
    torch._dynamo.reset()
    graphs = []
    cf = torch.compile(_attention_loss, backend=aot_graphs(graphs), fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lq, lk in [(17, 29), (33, 41)]:
            c = Case(1, lq, lk, 2, 1, 16, 16)
            q, k, v = make_qkv(c, requires_grad=True)
            bias = make_bias((1, 1, 1, lk), requires_grad=True)
            mask = make_mask((1, 1, 1, lk))
            loss = cf(q, k, v, bias, mask)
            loss.backward()
            ref = reference.attention(q, k, v, mask, bias, is_causal=True).square().sum()
            torch.testing.assert_close(loss, ref)
    assert "dmattn.attention_forward.default" in dmattn_nodes(graphs)


@gpu
def test_symbolic_sizes_trace_the_kernels(inductor_kernels):
    """A DMA call (per-key bias, top-k mask, causal, GQA, bf16) compiled with dynamic=True:
    the graphs launch our kernels (no dmattn op left in them), one compile serves every length
    from 100 to 5000 (the launchers' speed choices read the example's sizes without guarding,
    inductor.py), and each length's output and gradients stay within bf16's bound of the
    float64 oracle."""
    torch._dynamo.reset()
    graphs = []

    def loss_of(q, k, v, bias):
        mask = topk_mask(bias, 64)
        return torch.ops.dmattn.attention(q, k, v, mask, bias, None, True).float().square().sum()

    cf = torch.compile(loss_of, backend=aot_graphs(graphs), fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (300, 100, 777, 2048, 5000):
            c = Case(2, n, n, 8, 2, 64, 64)
            q, k, v = make_qkv(c, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            bias = make_bias((2, 2, 1, n), dtype=torch.bfloat16, device="cuda", requires_grad=True)
            got = torch.autograd.grad(cf(q, k, v, bias), (q, k, v, bias))
            mask = topk_mask(bias, 64)
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
            out = reference.attention(*leaves[:3], mask, leaves[3], is_causal=True)
            want = torch.autograd.grad(out.square().sum(), leaves)
            low = [t.detach().requires_grad_() for t in (q, k, v, bias)]  # the oracle in bf16
            out_low = reference.attention(*low[:3], mask, low[3], is_causal=True)
            lows = torch.autograd.grad(out_low.float().square().sum(), low)
            for name, g, w, lo in zip("qkvb", got, want, lows):
                bound = low_precision_bound(w, lo.double(), torch.bfloat16)
                assert_close(g.double(), w, bound, f"d{name} at L {n}")
    assert graphs and dmattn_nodes(graphs) == []


@pytest.fixture
def symbolic(monkeypatch):
    """(fake, grids) for running the launchers a compiled graph traces on fake tensors with a
    symbolic dim: fake(real, dim, name) is real's fake copy with `dim` (or a tuple of dims)
    symbolic; every launch is recorded in grids as (kernel name, grid) instead of made, its
    tensors cloned as functionalization does."""
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    from dmattn_ops.executors import _triton

    grids = []

    def launched(name, grid, args):
        # What functionalizing the launch does to its tensors (it clones those the kernel
        # writes, checking their layout: a dim that may be 1 would be guarded there).
        for t in args:
            if isinstance(t, torch.Tensor):
                t.clone()
        grids.append((name, grid))

    def record(kernel, grid):
        return lambda *args, **kwargs: launched(kernel._name, grid, args)

    monkeypatch.setattr(_triton.LazyKernel, "__getitem__", record)
    monkeypatch.setattr(
        _triton.LazyKernel, "run",
        lambda kernel, prepared, tensors: launched(kernel._name, prepared.grid, tensors),
    )  # fmt: skip
    monkeypatch.setattr(_triton, "tracing_on", lambda: True)
    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False)

    def fake(real, dim=None, name=None):
        real = real.to(DEVICE)
        if dim is None:
            return mode.from_tensor(real, static_shapes=True)
        dims = dim if isinstance(dim, tuple) else (dim,)
        sizes = [DimDynamic.DYNAMIC if i in dims else DimDynamic.STATIC for i in range(real.dim())]
        context = StatelessSymbolicContext(dynamic_sizes=sizes)
        return mode.from_tensor(real, symbolic_context=context, source=LocalSource(name))

    fake.mode = mode
    return fake, grids


def _guards_hold_at(env, lengths) -> None:
    """Every guard the trace put on its sizes holds with each of them (one symbol per tensor,
    all the same length in a real graph) set to each of `lengths`: a graph traced once would
    not be compiled again for any of them."""
    for guard in env.guards:
        for n in lengths:
            held = guard.expr.xreplace({s: n for s in guard.expr.free_symbols})
            assert bool(held), f"guard {guard.expr} ({guard.sloc}) fails at length {n}"


def _still_symbolic(*tensors) -> bool:
    """Whether each tensor has a symbolic size that no guard has pinned to a value."""
    for t in tensors:
        sizes = [s for s in t.shape if isinstance(s, torch.SymInt)]
        if not sizes or any(s.node.maybe_as_int() is not None for s in sizes):
            return False
    return True


def test_launchers_keep_sizes_symbolic(symbolic):
    """The launchers a compiled graph traces (attention forward and backward on key lists, the
    bias op both ways, the top-k selection), run on fake tensors whose sequence length is
    symbolic with every launch recorded instead of made: the length stays a free symbol, every
    guard put on it holds from 2 keys to 40000 (their speed choices read the example's sizes
    without guarding: one compile serves every length), and the grids are expressions of it."""
    from dmattn_ops import dt_bias, masks
    from dmattn_ops.registration import ops

    fake, grids = symbolic
    b, n, h, hkv, d = 2, 300, 4, 2, 32
    q = fake(torch.randn(b, n, h, d, dtype=torch.bfloat16), 1, "q")
    k = fake(torch.randn(b, n, hkv, d, dtype=torch.bfloat16), 1, "k")
    v = fake(torch.randn(b, n, hkv, d, dtype=torch.bfloat16), 1, "v")
    x = fake(torch.randn(b, n, hkv * d, dtype=torch.bfloat16), 1, "x")
    weight, c, a = (fake(t) for t in (torch.randn(hkv, hkv * d), torch.randn(hkv), torch.rand(hkv)))
    with fake.mode:
        bias, logits, values = dt_bias._forward_values(x, weight, c, a)
        mask = masks.topk_select(bias, None, 64, 0, True)  # the op's kernel body
        out, lse, rem = ops.forward_kernel(ops.DENSE_OPS)(
            q, k, v, mask, bias, d**-0.5, True, 0.0, None, False
        )  # fmt: skip
        grads = ops.backward_kernel(ops.DENSE_OPS)(
            torch.empty_like(out), None, q, k, v, out, lse, rem, mask, bias, d**-0.5, True,
            0.0, None, False, True,
        )  # fmt: skip
        dx, _ = dt_bias._backward(grads[3], values, weight, a, logits, grads[2].flatten(2))
    launched = {name for name, _ in grids}
    assert {"dt_bias_fwd_kernel", "topk_mask_kernel", "key_lists_kernel", "attention_fwd_kernel",
            "attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel",
            "dt_bias_bwd_kernel"} <= launched, launched  # fmt: skip
    assert _still_symbolic(q, out, grads[0], grads[1], grads[3], dx, mask)
    _guards_hold_at(fake.mode.shape_env, (2, 16, 100, 1000, 5000, 40000))
    assert any(
        isinstance(g, torch.SymInt) and g.node.maybe_as_int() is None
        for _, grid in grids for g in grid
    )  # fmt: skip


def test_unbacked_sizes_keep_the_ops_whole(symbolic):
    """The rules trace a call with fixed or symbolic sizes; one with a data-dependent size (no
    example value for the launchers' speed choices to read) keeps the op whole."""
    fake, _ = symbolic
    fixed = fake(torch.randn(2, 8))
    sized = fake(torch.randn(2, 8), 1, "x")
    with fake.mode:
        n = fake.mode.shape_env.create_unbacked_symint()
        unbacked = torch.empty(2, n)
    assert inductor._sizes((fixed, 1.0, None)) is None
    assert inductor._sizes((fixed, sized)) == "symbolic"
    assert inductor._sizes((sized, unbacked)) == "unbacked"


def test_symbolic_sizes_take_neither_decode_nor_gluon(symbolic):
    """Three paths are left out of graphs with symbolic sizes, without a guard on the length:
    the decode kernel (it takes a fixed Lq <= 16; comparing would pin the graph), the Gluon
    kernels (traced and tested with fixed sizes only), whatever the kernel option asks, and a
    window on PyTorch's fused kernels (taken in whole chunks and a tail: L modulo the window)."""
    from dmattn_ops.core import options
    from dmattn_ops.core.band import Band
    from dmattn_ops.core.problem import Options, Problem
    from dmattn_ops.dispatch import plan
    from dmattn_ops.executors import hopper

    fake, _ = symbolic
    q = fake(torch.randn(1, 8, 8, 128, dtype=torch.bfloat16), 1, "q")
    k = fake(torch.randn(1, 20000, 2, 128, dtype=torch.bfloat16), 1, "k")
    problem = Problem(q, k, k)
    (why,) = plan._decode_reasons(problem, plan._Pass(plan.FORWARD))
    assert "symbolic" in why
    for on in (None, True):
        assert hopper.reasons(problem, Band(True, False, 0, 0), 0.0, None, on, True) == [
            "symbolic sizes: the Gluon kernels are traced for fixed sizes only"
        ]
    windowed = Options(0.1, window=(255, 0))
    fused = plan._sdpa(problem, windowed, options.tuning(None), plan._Pass(plan.FORWARD))
    assert fused.kernel is None and "a window with symbolic sizes" in fused.reasons[0]
    assert fake.mode.shape_env.guards == []


def test_symbolic_sizes_read_masks_with_query_rows_in_the_dense_kernels(symbolic):
    """A mask with query rows takes the tile tables with fixed sizes; with symbolic ones the
    dense kernels read it (the table kernels hold a row of key tiles sized by the length, one
    graph per power of two), without a guard on the length."""
    from dmattn_ops.registration import ops

    fake, grids = symbolic
    b, n, h, hkv, d = 2, 200, 4, 2, 32
    q = fake(torch.randn(b, n, h, d, dtype=torch.bfloat16), 1, "q")
    k = fake(torch.randn(b, n, hkv, d, dtype=torch.bfloat16), 1, "k")
    v = fake(torch.randn(b, n, hkv, d, dtype=torch.bfloat16), 1, "v")
    mask = fake(torch.rand(b, 1, n, n) < 0.5, (2, 3), "mask")
    bias = fake(torch.randn(b, h, n, n, dtype=torch.bfloat16), (2, 3), "bias")
    with fake.mode:
        out, lse, rem = ops.forward_kernel(ops.DENSE_OPS)(
            q, k, v, mask, bias, d**-0.5, True, 0.0, None, False
        )  # fmt: skip
        ops.backward_kernel(ops.DENSE_OPS)(
            torch.empty_like(out), None, q, k, v, out, lse, rem, mask, bias, d**-0.5, True,
            0.0, None, False, True,
        )  # fmt: skip
    launched = {name for name, _ in grids}
    assert "attention_fwd_kernel" in launched and "attention_bwd_dq_kernel" in launched
    assert not any(name.startswith("tile_") for name in launched), launched
    assert _still_symbolic(q, out)
    _guards_hold_at(fake.mode.shape_env, (2, 16, 100, 1000, 5000, 40000))


def test_decoding_over_a_symbolic_cache_length_guards_nothing(symbolic):
    """One query against a cache whose length is symbolic (a compiled generate loop with a
    growing cache): the decode kernel runs with the example's split count, and no guard on
    the length remains (the cache may be shorter than a key tile or far longer)."""
    from dmattn_ops.registration import ops

    fake, grids = symbolic
    b, n, h, hkv, d = 2, 3000, 8, 2, 32
    q = fake(torch.randn(b, 1, h, d, dtype=torch.bfloat16))
    k = fake(torch.randn(b, n, hkv, d, dtype=torch.bfloat16), 1, "k")
    v = fake(torch.randn(b, n, hkv, d, dtype=torch.bfloat16), 1, "v")
    bias = fake(torch.randn(b, hkv, 1, n, dtype=torch.bfloat16), 3, "bias")
    mask = fake(torch.rand(b, hkv, 1, n) < 0.3, 3, "mask")
    with fake.mode:
        out, _, _ = ops.forward_kernel(ops.DENSE_OPS)(
            q, k, v, mask, bias, d**-0.5, True, 0.0, None, False
        )  # fmt: skip
    assert "attention_decode_kernel" in {name for name, _ in grids}
    assert out.shape == (b, 1, h, d)
    _guards_hold_at(fake.mode.shape_env, (1, 2, 16, 100, 5000, 40000))


@pytest.mark.parametrize("h, hkv, d", [(16, 4, 128), (4, 2, 32)], ids=["D128", "D32"])
def test_backward_takes_the_forwards_key_lists_under_symbolic_sizes(symbolic, h, hkv, d):
    """A compiled graph's backward reads the key lists its forward built (launch.KeptLists),
    found by the call's tensors and layout; with dynamic shapes the bias's head count is
    symbolic too (it does not hash), and the lists are still found: one key_lists launch for
    forward and backward."""
    from dmattn_ops.dispatch import launch
    from dmattn_ops.registration import ops

    fake, grids = symbolic
    # On an H200 the forward and dQ tiles agree at D128 and differ at D32 (128 and 64 rows):
    # the lists are then built at the finer tiling (plan._list_rows) and serve both.
    b, n = 2, 300
    q = fake(torch.randn(b, n, h, d, dtype=torch.bfloat16), 1, "q")
    k = fake(torch.randn(b, n, hkv, d, dtype=torch.bfloat16), 1, "k")
    v = fake(torch.randn(b, n, hkv, d, dtype=torch.bfloat16), 1, "v")
    bias = fake(torch.randn(b, hkv, 1, n, dtype=torch.bfloat16), 1, "bias")
    mask = fake(torch.rand(b, hkv, 1, n) < 0.3, 3, "mask")
    kept = launch.KeptLists()
    with fake.mode:
        out, lse, rem = ops.forward_kernel(ops.DENSE_OPS)(
            q, k, v, mask, bias, d**-0.5, True, 0.0, None, False, kept=kept
        )  # fmt: skip
        ops.backward_kernel(ops.DENSE_OPS)(
            torch.empty_like(out), None, q, k, v, out, lse, rem, mask, bias, d**-0.5, True,
            0.0, None, False, True, kept=kept,
        )  # fmt: skip
    assert [name for name, _ in grids].count("key_lists_kernel") == 1, grids
    assert kept._kept == {}


def test_varlen_launchers_keep_sizes_symbolic(symbolic):
    """The same for packed sequences: the packed token count and the longest sequence
    symbolic (as a compiled graph with dynamic shapes holds them), a mask and bias per key
    token."""
    from torch._dynamo.source import ConstantSource

    from dmattn_ops.registration import ops

    fake, grids = symbolic
    t, h, hkv, d = 700, 4, 2, 32
    q = fake(torch.randn(t, h, d, dtype=torch.bfloat16), 0, "q")
    k = fake(torch.randn(t, hkv, d, dtype=torch.bfloat16), 0, "k")
    v = fake(torch.randn(t, hkv, d, dtype=torch.bfloat16), 0, "v")
    bias = fake(torch.randn(hkv, t, dtype=torch.bfloat16), 1, "bias")
    mask = fake(torch.rand(hkv, t) < 0.5, 1, "mask")
    cu = fake(torch.tensor([0, 300, 700], dtype=torch.int32))
    env = fake.mode.shape_env
    longest = env.create_symintnode(env.create_symbol(400, ConstantSource("max_seqlen")), hint=400)
    with fake.mode:
        out, lse, rem = ops.forward_kernel(ops.VARLEN_OPS)(
            q, k, v, cu, cu, longest, longest, mask, bias, d**-0.5, True, 0.0, False
        )  # fmt: skip
        grads = ops.backward_kernel(ops.VARLEN_OPS)(
            torch.empty_like(out), None, q, k, v, out, lse, rem, cu, cu, longest, longest,
            mask, bias, d**-0.5, True, 0.0, False, True,
        )  # fmt: skip
    assert {"varlen_key_lists_kernel", "attention_fwd_kernel", "attention_bwd_dq_kernel",
            "attention_bwd_dkdv_kernel"} <= {name for name, _ in grids}  # fmt: skip
    assert _still_symbolic(q, out, lse, *grads[:4])
    _guards_hold_at(fake.mode.shape_env, (2, 16, 100, 1000, 5000, 40000))


def test_cache_keys_follow_the_fingerprint():
    """Every dmattn op records the fingerprint where AOTAutograd's cache key reads the Triton
    sources of an op (torch.library.triton_op's record), and the source that key hashes changes
    with a DMATTN_* switch."""
    from torch._inductor.codegen.wrapper import (
        user_defined_triton_kernel_transitive_closure_source_code as source,
    )
    from torch._library.triton import get_triton_kernels_for_op

    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("dmattn::")]
    assert "dmattn::attention" in names and "dmattn::topk_select" in names
    for name in names:
        assert any(isinstance(k, inductor._Fingerprint) for k in get_triton_kernels_for_op(name))
    (stand_in,) = [
        k for k in get_triton_kernels_for_op("dmattn::attention")
        if isinstance(k, inductor._Fingerprint)
    ]  # fmt: skip
    before = source(stand_in)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DMATTN_CUDNN_GRAPHS", "0")
        assert source(stand_in) != before
    assert source(stand_in) == before


def test_a_switch_misses_the_compile_cache(monkeypatch, tmp_path):
    """End to end: a graph compiled again after torch._dynamo.reset() comes from AOTAutograd's
    cache, and after a DMATTN_* switch changed it is compiled anew."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    q, k, v = (torch.randn(1, 16, 2, 16) for _ in range(3))

    def compile_and_run():
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: dmattn_ops.attention(q, k, v, is_causal=True))
        with torch.no_grad():
            fn(q, k, v)

    with torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=False), \
            torch._functorch.config.patch(enable_autograd_cache=True):  # fmt: skip
        counters.clear()
        compile_and_run()
        compile_and_run()
        assert counters["aot_autograd"]["autograd_cache_hit"] == 1
        monkeypatch.setenv("DMATTN_SOME_SWITCH", "1")
        compile_and_run()
        assert counters["aot_autograd"]["autograd_cache_hit"] == 1
        assert counters["aot_autograd"]["autograd_cache_miss"] == 2


ACCESS = """
import torch
import triton
from triton.backends.compiler import GPUTarget
from torch._higher_order_ops import triton_kernel_wrap

import dmattn_ops
from dmattn_ops import dt_bias, masks
from dmattn_ops.core import configs
from dmattn_ops.dispatch import plan
from dmattn_ops.executors import _triton
from dmattn_ops.registration import ops


class Target:  # Inductor's analysis builds TTIR for the active driver's target: an H100's
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Target())
plan.interpreter_on = lambda: True  # CPU tensors take the Triton routes, with a GPU's tiles:
config = configs.config
configs.config = lambda *a, **k: config(*a, **{**k, "interpreter": False, "limit": 232448})
_triton.tracing_on = lambda: False
_triton.launch_cache_on = lambda: False
inputs, alive, launched = set(), [], []


def written(fn, kwargs):  # the names Inductor takes the kernel to write
    if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):  # newer torch
        access = triton_kernel_wrap.identify_accessed_tensors(fn, kwargs, {})
        return [dep.name for dep in access.read_writes.writes]
    return triton_kernel_wrap.identify_mutated_tensors(fn, kwargs, {})  # torch 2.11


def analyse(fn, args, meta):
    kwargs = dict(zip(fn.arg_names, args)) | meta
    for name in written(fn, kwargs):
        launched.append(fn.__name__)
        assert kwargs[name].untyped_storage().data_ptr() not in inputs, (fn.__name__, name)


_triton.LazyKernel.run = lambda self, p, tensors: analyse(self.fn, (*tensors, *p.scalars), p.meta)
_triton.LazyKernel.__getitem__ = lambda self, grid: lambda *a, **m: analyse(self.fn, a, m)


def given(*tensors):
    alive.extend(tensors)  # their storages stay theirs
    inputs.update(t.untyped_storage().data_ptr() for t in tensors if t is not None)
    return tensors


fwd, bwd = ops.forward_kernel(ops.DENSE_OPS), ops.backward_kernel(ops.DENSE_OPS)
b, n, h, hkv, d, dt = 2, 256, 4, 2, 64, torch.bfloat16
q, k, v = torch.randn(b, n, h, d, dtype=dt), *torch.randn(2, b, n, hkv, d, dtype=dt)
bias, used = torch.randn(b, hkv, 1, n, dtype=dt), torch.tensor([100, 256], dtype=torch.int32)
keys, rows = torch.rand(b, hkv, 1, n) < 0.3, torch.rand(b, 1, n, n) < 0.3
for mask, bias_, seqused in ((keys, bias, None), (None, bias, used), (rows, None, used),
                             (None, torch.randn(1, 1, n, n, dtype=dt), None)):
    given(q, k, v, mask, bias_, seqused)
    out, lse, rem = given(*fwd(q, k, v, mask, bias_, d**-0.5, True, 0.0, seqused, False))
    grad = given(torch.randn_like(out))[0]
    bwd(grad, None, q, k, v, out, lse, rem, mask, bias_, d**-0.5, True, 0.0, seqused, False,
        bias_ is not None)
with dmattn_ops.kernel_options(dkdv_split=2):  # the dK/dV parts and their reduce kernel
    out, lse, rem = given(*fwd(q, k, v, keys, bias, d**-0.5, True, 0.0, None, False))
    bwd(grad, None, q, k, v, out, lse, rem, keys, bias, d**-0.5, True, 0.0, None, False, True)
one = given(torch.randn(b, 1, h, d, dtype=dt))[0]
fwd(one, k, v, keys, bias, d**-0.5, True, 0.0, used, False)  # decode

lens = torch.tensor([0, 5, 105, 135], dtype=torch.int32)
qp, kp, vp = given(torch.randn(135, h, d, dtype=dt), *torch.randn(2, 135, hkv, d, dtype=dt))
mp, bp = given(torch.rand(hkv, 135) < 0.5, torch.randn(hkv, 135, dtype=dt))
given(lens)
varlen = ops.forward_kernel(ops.VARLEN_OPS), ops.backward_kernel(ops.VARLEN_OPS)
out, lse, rem = given(*varlen[0](qp, kp, vp, lens, lens, 100, 100, mp, bp, d**-0.5, True, 0.0,
                                 False))
grad = given(torch.randn_like(out))[0]
varlen[1](grad, None, qp, kp, vp, out, lse, rem, lens, lens, 100, 100, mp, bp, d**-0.5, True,
          0.0, False, True)

masks.topk_select(*given(bias, None), 64, 0)
x, w, c, a = given(torch.randn(b, n, 32, dtype=dt), torch.randn(hkv, 32), *torch.randn(2, hkv))
_, logits, _ = given(*dt_bias._forward_values(x, w, c, a))
dt_bias._backward(*given(torch.randn(b, hkv, 1, n, dtype=dt), torch.randn(b, n, 32, dtype=dt)),
                  x, w, a, logits)
print(" ".join(sorted(set(launched))))
"""


def test_inductor_finds_each_kernel_writing_its_outputs_alone():
    """Inductor's analysis of a user kernel (identify_accessed_tensors; on torch 2.11
    identify_mutated_tensors: what a compiled graph takes a kernel to read and write) finds
    none of ours writing a tensor the call was given: a compiled call mutates none of its
    inputs (cu_seqlens and seqused_k were counted as written where a helper read them:
    kernels/common.seq_extent). Every Triton route: key lists (with the dK/dV split and its
    reduce), the dense kernels with seqused_k, tile tables, the dbias kernel, decode, varlen
    forward and backward, top-k, the bias op (H100 tiles, TTIR built for sm_90 without a
    GPU, out of the interpreter). Not the Gluon kernels (hopper.py), which need an sm_90
    device to be chosen."""
    pytest.importorskip("triton")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", ACCESS], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(__file__), timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    kernels = set(res.stdout.split())
    for name in ("key_lists_kernel", "varlen_key_lists_kernel", "attention_fwd_kernel",
                 "attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel", "tile_rows_kernel",
                 "attention_bwd_dbias_kernel", "attention_bwd_dkdv_reduce_kernel",
                 "attention_decode_kernel", "topk_mask_kernel",
                 "dt_bias_fwd_kernel", "dt_bias_bwd_kernel"):  # fmt: skip
        assert name in kernels, (name, kernels)


@gpu
def test_compiled_calls_mutate_none_of_their_inputs(inductor_kernels):
    """A compiled decode step over a KV cache with seqused_k, and a compiled packed-sequence
    call, write none of their inputs in the graph (no copy back into seqused_k or cu_seqlens:
    kernels/common.seq_extent), so mode="reduce-overhead" runs both under CUDA graphs, each
    call equal to eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    b, n, h, hkv, d = 2, 300, 8, 2, 64
    cache_k, cache_v = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))  # fmt: skip
    cache_bias = make_bias((b, hkv, 1, n), dtype=torch.bfloat16, device="cuda")

    def decode(q, used, cache_k, cache_v, cache_bias):  # arguments: aot_function fakes them
        return dmattn_ops.attention(q, cache_k, cache_v, None, cache_bias, seqused_k=used)

    def packed(q, k, v, cu, bias):
        return dmattn_ops.attention_varlen(q, k, v, cu, cu, 200, 200, None, bias, is_causal=True)

    cu = torch.tensor([0, 50, 250, 300], dtype=torch.int32, device="cuda")
    qp, kp, vp = (torch.randn(300, hh, d, device="cuda", dtype=torch.bfloat16)
                  for hh in (h, hkv, hkv))  # fmt: skip
    bp = torch.randn(hkv, 300, device="cuda", dtype=torch.bfloat16)
    calls = [(decode, lambda i: (torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16),
                                 torch.tensor([100 + i, 290 - i], dtype=torch.int32,
                                              device="cuda"), cache_k, cache_v, cache_bias)),
             (packed, lambda i: (qp, kp, vp, cu, bp))]  # fmt: skip
    for fn, inputs in calls:
        _, graphs = _graphs_of(fn, *inputs(0))
        copies = [n for g in graphs for n in g.graph.nodes if "copy_" in str(n.target)]
        assert dmattn_nodes(graphs) == [] and copies == [], fn.__name__
        compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
        for i in range(3):  # warm-up, record, replay
            args = inputs(i)
            got = compiled(*args).clone()
            torch.testing.assert_close(got, fn(*args), rtol=0, atol=0)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
