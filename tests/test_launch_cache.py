"""Eager launches reuse compiled kernels (dmattn_ops/executors/_triton.py LaunchCache): the key separates
every launch Triton would compile differently, a hit passes every parameter in signature order,
and on the GPU the cached launches compute bitwise what Triton's own launch path computes."""

import inspect

import pytest
import torch
from helpers import DEVICE

import dmattn_ops
from dmattn_ops.dispatch import launch, plan
from dmattn_ops.executors import _triton, tiles
from dmattn_ops.executors._triton import LaunchCache

gpu = pytest.mark.gpu


class _Compiled:
    """A stand-in for triton.compiler.CompiledKernel: its launches, and a source signature with
    one entry per parameter (or fewer, as older Triton's launchers had)."""

    def __init__(self, n_params):
        self.src = type("Src", (), {"signature": dict.fromkeys(range(n_params))})()
        self.launched = []

    def run(self, *args):  # present on real compiled kernels; the cache checks for it
        raise AssertionError("launched through __getitem__")

    def __getitem__(self, grid):
        return lambda *args: self.launched.append((grid, args))


class _Jit:
    """A stand-in for a @triton.jit function of (x, n, scale, BLOCK: constexpr, FLAG=True)."""

    def __init__(self, full_signature=True, hooks=()):
        def kernel(x, n, scale, BLOCK, FLAG=True):
            pass

        self.signature = inspect.signature(kernel)
        self.pre_run_hooks = list(hooks)
        self.compiled = _Compiled(5 if full_signature else 3)
        self.compiles = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiles.append((grid, args, kwargs))
            return self.compiled

        return run


def _key(*args, device=0, **kwargs):
    return LaunchCache().key(args, kwargs, device)


def test_the_key_separates_what_triton_specialises_on():
    x = torch.zeros(64, dtype=torch.float32)
    base = _key(x, 7, 0.5, BLOCK=64)
    assert base == _key(torch.ones(64), 7, 0.5, BLOCK=64)  # another tensor, same kind
    assert base != _key(x.to(torch.float16), 7, 0.5, BLOCK=64)  # dtype
    assert base != _key(x[1:], 7, 0.5, BLOCK=64)  # a 4-byte offset: not 16-byte aligned
    assert base != _key(x, 16, 0.5, BLOCK=64)  # ints by value
    assert _key(x, 1, 0.5, BLOCK=64) != _key(x, True, 0.5, BLOCK=64)  # 1 == True in Python
    assert _key(x, 1, 0.5, BLOCK=64) != _key(x, 1.0, 0.5, BLOCK=64)  # 1 == 1.0 in Python
    assert base != _key(None, 7, 0.5, BLOCK=64)
    assert base != _key(x, 7, 0.5, BLOCK=32)  # constexprs
    assert base != _key(x, 7, 0.5, BLOCK=64, num_warps=8)  # launch options
    assert base != _key(x, 7, 0.5, BLOCK=64, device=1)
    assert _key(x, x, 7, BLOCK=64) != _key(x, 7, 7, BLOCK=64)  # layouts
    assert _key(x) == _key(torch.ones(2)) and _key(3) != _key(4) and _key() == _key()


def test_the_key_takes_a_tma_descriptor_by_what_triton_specialises_on():
    """Descriptors (the Hopper kernels' operands) are keyed by dtype, block shape and layout, not
    by value: their shape and strides are runtime values, and the dataclass is unhashable."""
    tensor_descriptor = pytest.importorskip("triton.tools.tensor_descriptor")

    def desc(t, block):
        return tensor_descriptor.TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    x = torch.zeros(64, 128, dtype=torch.float16)
    base = _key(desc(x, [16, 128]), 7)
    assert base == _key(desc(torch.ones(32, 128, dtype=torch.float16), [16, 128]), 7)
    assert base != _key(desc(x, [32, 128]), 7)  # block shape
    assert base != _key(desc(x.float(), [16, 128]), 7)  # dtype
    assert base != _key(x, 7)


def test_a_hit_passes_every_parameter_in_signature_order():
    cache, fn = LaunchCache(), _Jit()
    x = torch.zeros(8)
    assert cache.launch(fn, (3, 2), (x, 5, 0.25), {"BLOCK": 16}, 0) is fn.compiled
    assert len(fn.compiles) == 1 and fn.compiled.launched == []  # a miss: Triton's path
    cache.launch(fn, (3, 2), (torch.ones(8), 5, 0.25), {"BLOCK": 16}, 0)
    cache.launch(fn, (4,), (x, 5, 0.25), {"BLOCK": 16, "FLAG": False}, 0)  # another key
    assert len(fn.compiles) == 2
    (grid, args), = fn.compiled.launched  # fmt: skip
    assert grid == (3, 2, 1) and args[1:] == (5, 0.25, 16, True)  # FLAG's default appended
    assert len(cache) == 2


@pytest.mark.parametrize("reason", ["older launcher", "pre-run hook"])
def test_kernels_it_cannot_relaunch_are_not_kept(reason):
    fn = _Jit(full_signature=reason != "older launcher", hooks=[print] * (reason == "pre-run hook"))
    cache = LaunchCache()
    for _ in range(2):
        cache.launch(fn, (1,), (torch.zeros(4), 2, 1.0), {"BLOCK": 16}, 0)
    assert len(fn.compiles) == 2 and len(cache) == 0


def test_the_oldest_entry_goes_first(monkeypatch):
    monkeypatch.setattr(LaunchCache, "SIZE", 3)
    cache, fn = LaunchCache(), _Jit()
    for n in range(5):
        cache.launch(fn, (1,), (torch.zeros(4), n, 1.0), {"BLOCK": 16}, 0)
    assert len(cache) == 3
    cache.launch(fn, (1,), (torch.zeros(4), 4, 1.0), {"BLOCK": 16}, 0)  # kept
    cache.launch(fn, (1,), (torch.zeros(4), 0, 1.0), {"BLOCK": 16}, 0)  # evicted
    assert len(fn.compiles) == 6


def test_a_prepared_launch_keeps_its_kernel_by_the_tensors_alignment(monkeypatch):
    """LazyKernel.run: the first launch of a Prepared goes through Triton's path (and LaunchCache);
    later ones call the kept kernel with the tensors, the scalars and the trailing parameters
    in signature order; a misaligned tensor, or one of another dtype, gets its own kernel."""
    monkeypatch.setattr(_triton, "launch_cache_on", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fn = _Jit()
    kernel = _triton.LazyKernel(lambda: (), "kernel")
    kernel.fn = fn  # the cached_property's slot
    args = _triton.Prepared((3, 2), (5, 0.25), {"BLOCK": 16})
    x = torch.zeros(8)
    assert kernel.run(args, (x,)) is fn.compiled
    assert len(fn.compiles) == 1 and fn.compiled.launched == []
    kernel.run(args, (torch.ones(8),))
    (grid, launched), = fn.compiled.launched  # fmt: skip
    assert grid == (3, 2, 1) and launched[1:] == (5, 0.25, 16, True)
    kernel.run(args, (x[1:],))  # 4 bytes past alignment
    kernel.run(args, (x.double(),))
    assert len(fn.compiles) == 3 and len(args.compiled) == 3


def test_prepared_arguments_are_checked_against_a_fresh_build(monkeypatch):
    """prepared(): made once per store and key; under DMATTN_CHECK_PREPARED=1 (the suite's
    setting) a later build that differs, even by a scalar's type only, raises."""
    store, builds = {}, []

    def build(value):
        builds.append(value)
        return _triton.Prepared((1,), (value,), {"BLOCK": 16})

    monkeypatch.setenv("DMATTN_CHECK_PREPARED", "0")
    first = _triton.prepared(store, ("site",), lambda: build(1))
    assert _triton.prepared(store, ("site",), lambda: build(2)) is first and builds == [1]
    monkeypatch.setenv("DMATTN_CHECK_PREPARED", "1")
    assert _triton.prepared(store, ("site",), lambda: build(1)) is first
    for changed in (2, 1.0):
        with pytest.raises(AssertionError, match="changed under one plan"):
            _triton.prepared(store, ("site",), lambda c=changed: build(c))


def test_launch_arguments_are_made_once_per_plan(monkeypatch):
    """Repeated DMA calls of one signature make the forward's, the backward's and the key lists'
    launch arguments once (their plan keeps them); a gradient of another layout makes the
    backward's again, and computes what the contiguous one does."""
    monkeypatch.setenv("DMATTN_CHECK_PREPARED", "0")
    made = []
    for name in ("_forward_args", "_dq_args", "_dkdv_args"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _r=real, _n=name: made.append(_n) or _r(*a))
    b, n, h, hkv, d = 1, 64, 4, 2, 16
    q = torch.randn(b, n, h, d, device=DEVICE)
    k, v = (torch.randn(b, n, hkv, d, device=DEVICE) for _ in "kv")
    bias = torch.randn(b, hkv, 1, n, device=DEVICE)
    mask = bias >= bias.topk(16, dim=-1).values[..., -1:]
    grad = torch.randn(b, n, h, d, device=DEVICE)

    def step(grad):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = dmattn_ops.attention(*leaves[:3], mask, leaves[3], is_causal=True, backend="triton")
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    first = step(grad)
    once = sorted(made)
    assert once == ["_dkdv_args", "_dq_args", "_forward_args"]
    step(grad)
    assert sorted(made) == once
    strided = torch.empty(b, h, n, d, device=DEVICE).transpose(1, 2).copy_(grad)
    again = step(strided)
    assert sorted(made) == sorted([*once, "_dq_args", "_dkdv_args"])
    for f, a in zip(first, again):
        torch.testing.assert_close(a, f, rtol=0, atol=0)


def test_a_decode_step_makes_its_launches_once(monkeypatch):
    """Decode steps of one cache shape (the serving loop) make the decode kernel's, the merge's
    and the key lists' arguments once, and compute what a fresh plan computes."""
    monkeypatch.setenv("DMATTN_CHECK_PREPARED", "0")
    made = []
    real = launch._decode_layout
    monkeypatch.setattr(launch, "_decode_layout", lambda *a: made.append(1) or real(*a))
    b, lk, h, hkv, d = 2, 200, 4, 2, 32
    q = torch.randn(b, 1, h, d, device=DEVICE)
    k, v = (torch.randn(b, lk, hkv, d, device=DEVICE) for _ in "kv")
    bias = torch.randn(b, hkv, 1, lk, device=DEVICE)
    mask = bias >= bias.topk(48, dim=-1).values[..., -1:]
    sinks = torch.randn(h, device=DEVICE)

    def step():
        return dmattn_ops.attention(q, k, v, mask, bias, sinks=sinks, backend="triton")

    first = step()
    assert made == [1]
    for _ in range(2):
        assert torch.equal(step(), first)
    assert made == [1]
    plan._CACHE.clear()  # a fresh plan makes them again, to the same result
    assert torch.equal(step(), first) and made == [1, 1]


def test_tile_tables_make_their_launches_once_per_plan(monkeypatch):
    """A mask that varies over the queries (the tile tables' route): repeated calls of one
    signature make the tables' buffers and launches once per grid, with the same results."""
    monkeypatch.setenv("DMATTN_CHECK_PREPARED", "0")
    made = []
    real = tiles._tables_layout
    monkeypatch.setattr(tiles, "_tables_layout", lambda *a: made.append(1) or real(*a))
    b, n, h, d = 1, 80, 2, 16
    q, k, v = (torch.randn(b, n, h, d, device=DEVICE) for _ in "qkv")
    mask = torch.rand(b, h, n, n, device=DEVICE) > 0.3
    grad = torch.randn(b, n, h, d, device=DEVICE)

    def step():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dmattn_ops.attention(*leaves, mask, is_causal=True, backend="triton")
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    first = step()
    once = len(made)
    assert once >= 2  # the forward's grid and the backward's
    for got, want in zip(step(), first):
        assert torch.equal(got, want)
    assert len(made) == once


def test_off_under_the_interpreter_and_the_switch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _triton.launch_cache_on()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DMATTN_LAUNCH_CACHE", "0")
    assert not _triton.launch_cache_on()
    monkeypatch.setenv("DMATTN_LAUNCH_CACHE", "1")
    assert _triton.launch_cache_on()


def _dma_step(q, k, v, mask, bias, grad):
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    out = dmattn_ops.attention(*leaves[:3], mask, leaves[3], is_causal=True, backend="triton")
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _dma_operands(offset=0):
    """B2 L256 H4 Hkv2 D64 bf16 with a key mask and bias shared by all queries (key lists and
    packed rows); `offset` elements before each of q, k, v in its storage."""
    b, n, h, hkv, d = 2, 256, 4, 2, 64

    def rows(heads):
        flat = torch.randn(offset + b * n * heads * d, device="cuda", dtype=torch.bfloat16)
        return flat[offset:].view(b, n, heads, d)

    q, k, v = rows(h), rows(hkv), rows(hkv)
    scores = torch.randn(b, hkv, 1, n, device="cuda")
    mask = scores >= scores.topk(64, dim=-1).values[..., -1:]
    bias = torch.randn(b, hkv, 1, n, device="cuda", dtype=torch.bfloat16)
    return q, k, v, mask, bias, torch.randn_like(q)


@gpu
def test_cached_launches_match_tritons_own_bitwise(monkeypatch):
    operands = _dma_operands()
    monkeypatch.setenv("DMATTN_LAUNCH_CACHE", "0")
    expected = _dma_step(*operands)
    monkeypatch.setenv("DMATTN_LAUNCH_CACHE", "1")
    first = _dma_step(*operands)  # misses: launched by Triton, kept
    kept = len(launch.attention_fwd_kernel.launches), len(tiles.key_lists_kernel.launches)
    assert kept[0] >= 1 and kept[1] >= 1
    again = _dma_step(*operands)  # hits
    assert (len(launch.attention_fwd_kernel.launches), len(tiles.key_lists_kernel.launches)) == kept
    for e, f, a in zip(expected, first, again):
        assert torch.equal(e, f) and torch.equal(e, a)


@gpu
def test_a_misaligned_operand_gets_its_own_kernel():
    """q, k, v 2 bytes past 16-byte alignment after aligned calls: a kernel compiled for aligned
    addresses must not be reused for them (its vector loads would fault or read wrong rows)."""
    aligned = _dma_operands()
    expected = _dma_step(*aligned)
    before = len(launch.attention_fwd_kernel.launches)
    shifted = _dma_operands(offset=1)
    assert shifted[0].data_ptr() % 16 == 2
    for t, src in zip(shifted[:3], aligned[:3]):
        t.copy_(src)
    got = _dma_step(*shifted[:3], *aligned[3:])  # the same mask, bias and grad
    assert len(launch.attention_fwd_kernel.launches) > before
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def test_empties_carves_aligned_disjoint_buffers_one_allocation_a_dtype():
    """Fewer torch.empty calls a key-list call (executors/_alloc.py): the buffers of one dtype
    share one storage, each starts ALIGN_BYTES into it, none overlaps another, floats are
    NaN-poisoned under test as `empty`'s are."""
    from dmattn_ops.executors._alloc import ALIGN_BYTES, empties

    i32, bf16 = torch.int32, torch.bfloat16
    specs = [((2, 3, 5), i32), None, ((7,), bf16), ((1,), i32), ((4, 33), bf16), ((0, 3), i32)]
    got = empties(specs, device="cpu")
    assert got[1] is None
    for t, spec in zip(got, specs):
        if spec is not None:
            assert t.shape == spec[0] and t.dtype == spec[1] and t.is_contiguous()
            assert t.storage_offset() * t.element_size() % ALIGN_BYTES == 0
    storages = {t.dtype: set() for t in got if t is not None}
    for t in got:
        if t is not None:
            storages[t.dtype].add(t.untyped_storage().data_ptr())
    assert all(len(s) == 1 for s in storages.values()) and len(storages) == 2
    assert all(t.isnan().all() for t in got if t is not None and t.is_floating_point())
    for i, t in enumerate(got):
        if t is not None:
            t.fill_(i)
    assert all((t == i).all() for i, t in enumerate(got) if t is not None)


class _GluonJit(_Jit):
    """A stand-in for a Gluon kernel of (x_desc, y, n, scale, BLOCK: constexpr, FLAG=True)."""

    def __init__(self):
        super().__init__()

        def kernel(x_desc, y, n, scale, BLOCK, FLAG=True):
            pass

        self.signature = inspect.signature(kernel)
        self.compiled = _Compiled(6)
        self.fn = self


def test_gluon_launches_are_kept_per_operand_layout(monkeypatch):
    """executors/_gluon.py launched: the first launch of an operand layout goes through the
    kernel's own launch and is kept; a later one with other tensors of that layout calls the
    kept kernel with exactly the arguments a fresh build makes (its descriptor rebased on the
    new tensor), and with DMATTN_CHECK_PREPARED (the tests' setting) a launcher reading
    anything the key leaves out raises. A launch whose descriptor reads a copy, or whose
    operands alias, is never kept."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from dmattn_ops.executors import _gluon, hopper

    monkeypatch.setattr(_gluon, "launch_cache_on", lambda: True)  # off under the interpreter
    monkeypatch.setattr(_gluon, "_cuda_device", lambda t: 0)  # CPU tensors stand in
    monkeypatch.setattr(_gluon, "_READY", {})
    jit, outside = _GluonJit(), {"n": 7}

    @_gluon.launched
    def launch(x, y, scale):
        args = (hopper._descriptor(x, 16), y, outside["n"], float(scale))
        return jit, (3,), args, dict(BLOCK=64)

    def operands():
        return torch.randn(2, 40, 4, 64).bfloat16(), torch.zeros(8, dtype=torch.int32)

    x1, y1 = operands()
    launch(x1, y1, 0.5)
    assert len(jit.compiles) == 1 and len(_gluon._READY) == 1
    x2, y2 = operands()
    launch(x2, y2, 0.5)
    assert len(jit.compiles) == 1, "a kept layout goes straight to the compiled kernel"
    grid, (desc, y, n, scale, block, flag) = jit.compiled.launched[-1]
    fresh = hopper._descriptor(x2, 16)
    assert grid == (3, 1, 1) and desc.base is x2 and vars(desc) == vars(fresh)
    assert y is y2 and (n, scale, block, flag) == (7, 0.5, 64, True)
    monkeypatch.delenv("DMATTN_CHECK_PREPARED")
    launch(x2, y2, 0.25)  # another scale: another key
    assert len(jit.compiles) == 2 and len(_gluon._READY) == 2
    outside["n"] = 8  # read by the launcher, not in the key: unchecked, the kept 7 goes
    launch(x1, y1, 0.5)
    assert jit.compiled.launched[-1][1][2] == 7
    monkeypatch.setenv("DMATTN_CHECK_PREPARED", "1")
    with pytest.raises(AssertionError, match="kept launch arguments"):
        launch(x1, y1, 0.5)
    outside["n"] = 7
    # A descriptor of a copy (a last dim of stride 2 is no TMA layout) and aliased operands.
    strided = torch.randn(2, 40, 4, 128).bfloat16()[..., ::2]
    for x, y in ((strided, y1), (x1, x1)):
        compiles = len(jit.compiles)
        launch(x, y, 0.5)
        launch(x, y, 0.5)
        assert len(jit.compiles) == compiles + 2
    assert list(_gluon._READY.values()).count(_gluon._UNKEPT) == 2
    # DMATTN_LAUNCH_CACHE=0 keeps nothing and reads nothing kept; the store is bounded.
    monkeypatch.setattr(_gluon, "launch_cache_on", lambda: False)
    kept, compiles = dict(_gluon._READY), len(jit.compiles)
    launch(x2, y2, 0.5)
    assert len(jit.compiles) == compiles + 1
    assert _gluon._READY.keys() == kept.keys()
    monkeypatch.setattr(_gluon, "launch_cache_on", lambda: True)
    monkeypatch.setattr(_gluon, "_READY_SIZE", len(_gluon._READY))
    launch(x2, y2, 0.125)  # a new key in a full store: the store starts over
    assert list(_gluon._READY) == [_gluon._launch_key(launch.__wrapped__, (x2, y2, 0.125))]
