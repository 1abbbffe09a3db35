"""Context parallelism: ring_attention over 2, 3 and 4 processes equals attention on the whole
sequence, outputs and every gradient (issue 17). On CPU (gloo, float64) against
dmattn_ops.attention to float64 rounding; on GPUs (NCCL, bf16, one GPU per rank; 2 and 4 ranks)
against the float64 oracle, within PyTorch's own bf16 error (tests/helpers.py)."""

import contextlib
import faulthandler
import itertools
import math
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = [
    # (layout, is_causal, with_operands, h, hkv, softcap, bias of every key of KV head 0)
    ("zigzag", True, True, 4, 2, 0.0, None),
    ("zigzag", False, True, 4, 4, 3.0, None),
    ("contiguous", True, True, 4, 1, 0.0, None),
    ("contiguous", False, False, 2, 2, 0.0, None),
    ("zigzag", True, False, 4, 2, 5.0, None),
    # Rows whose every block is equally "almost masked": each block's lse rounds to the bias,
    # and the merge must still weigh the blocks by their key counts (issue 48).
    ("zigzag", True, True, 4, 2, 0.0, torch.finfo(torch.float32).min),
    ("contiguous", False, True, 4, 2, 0.0, torch.finfo(torch.float64).min),
    ("contiguous", True, True, 2, 1, 0.0, -1e8),
]


@contextlib.contextmanager
def _process_group(rank: int, world: int, rendezvous: str, failures):
    """A gloo group of `world` processes for the body; a failure is queued with its traceback
    (the test prints every rank's) and raised."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        yield
        # Every rank done before any tears its connections down: under torch 2.15 one rank of
        # a passing run was once aborted by gloo ("terminate called without an active
        # exception") as the others exited (CI, session 55; not reproduced in 36 runs).
        dist.barrier()
    except Exception:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, rendezvous: str, failures, device_type: str = "cpu") -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import assert_close, float64_grad_bound, low_precision_bound

    import dmattn_ops
    from dmattn_ops import distributed as cp
    from dmattn_ops import reference

    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}",
                            rank=rank, world_size=world)  # fmt: skip
    try:
        for layout, is_causal, with_operands, h, hkv, softcap, lowest in CONFIGS:
            if cuda and lowest == torch.finfo(torch.float64).min:
                continue  # bf16 cannot hold it
            g = torch.Generator().manual_seed(7)  # the same whole tensors on every rank
            b, length, d = (2, 64 * 2 * world, 64) if cuda else (2, 4 * world * 3, 8)
            q = torch.randn(b, length, h, d, generator=g, dtype=torch.float64)
            k = torch.randn(b, length, hkv, d, generator=g, dtype=torch.float64)
            v = torch.randn(b, length, hkv, d, generator=g, dtype=torch.float64)
            bias = mask = None
            if with_operands:
                bias = torch.randn(b, hkv, 1, length, generator=g, dtype=torch.float64)
                mask = torch.rand(b, 1, 1, length, generator=g) < 0.6
                mask[..., 0] = True
                if lowest is not None:
                    bias[:, 0] = lowest
            w = torch.randn(b, length, h, d, generator=g, dtype=torch.float64)
            kw = dict(is_causal=is_causal, softcap=softcap)

            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            whole_bias = bias.clone().requires_grad_() if bias is not None else None
            want = (dmattn_ops if not cuda else reference).attention(*whole, mask, whole_bias, **kw)
            (want * w).sum().backward()
            _, lse = reference.attention(q, k, v, mask, bias, return_lse=True, **kw)
            wanted = [want.detach()] + [t.grad for t in whole]
            wanted += [whole_bias.grad] if bias is not None else []
            if cuda:
                # The float64 oracle, PyTorch's own bf16 error beside it (the bound), and the
                # inputs in bf16 on this rank's GPU.
                lowp = [t.bfloat16().requires_grad_() for t in (q, k, v)]
                lowp_bias = bias.bfloat16().requires_grad_() if bias is not None else None
                out_lp = reference.attention(*lowp, mask, lowp_bias, **kw)
                (out_lp.double() * w).sum().backward()
                in_lowp = [out_lp.detach()] + [t.grad for t in lowp]
                in_lowp += [lowp_bias.grad] if bias is not None else []
                q, k, v, w = (t.cuda().bfloat16() for t in (q, k, v, w))
                mask = mask.cuda() if mask is not None else None
                bias = bias.cuda().bfloat16() if bias is not None else None

            def part(t, dim=1, layout=layout):
                return cp.shard(t, dim, layout=layout) if t is not None else None

            local = [part(t).requires_grad_() for t in (q, k, v)]
            local_bias = part(bias, 3).requires_grad_() if bias is not None else None
            out = cp.ring_attention(*local, part(mask, 3), local_bias, layout=layout, **kw)
            (out * part(w)).sum().backward()
            what = f"{layout} causal={is_causal} operands={with_operands} H{h} Hkv{hkv}"
            got = [cp.unshard(out.detach(), 1, layout=layout)]
            got += [cp.unshard(t.grad, 1, layout=layout) for t in local]
            if bias is not None:
                got.append(cp.unshard(local_bias.grad, 3, layout=layout))
            for i, (name, a, e) in enumerate(zip(("out", "dq", "dk", "dv", "dbias"), got, wanted)):
                if cuda:
                    bound = low_precision_bound(e, in_lowp[i], torch.bfloat16)
                    assert_close(a.cpu().double(), e, bound, f"{what} {name}")
                else:
                    assert_close(a, e, float64_grad_bound(e, lse), f"{what} {name}")
    except Exception:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path, device_type: str) -> None:
    _spawn_worker(_worker, world, tmp_path, device_type)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_equals_attention_on_the_whole_sequence(world, tmp_path):
    _spawn(world, tmp_path, "cpu")


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_on_gpus_with_nccl_in_bf16(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    _spawn(world, tmp_path, "cuda")


def _packed_inputs(length: int, h: int, hkv: int, d: int, seed: int):
    """(q, k, v, bias, mask, w, sinks) of a whole packed sequence, float64, the same on every
    rank: q/k/v (L, H|Hkv, D), per-key bias (Hkv, L) and mask (1, L) (70% kept), an upstream
    gradient w like q, sinks (H,)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(length, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(length, hkv, d, generator=g, dtype=torch.float64)
    bias = torch.randn(hkv, length, generator=g, dtype=torch.float64)
    mask = torch.rand(1, length, generator=g) < 0.7
    w = torch.randn(length, h, d, generator=g, dtype=torch.float64)
    return q, k, v, bias, mask, w, torch.randn(h, generator=g, dtype=torch.float64)


def _band_oracle(q, k, v, bias, mask, sinks, cu, kw):
    """reference.attention over the whole (L, H, D) sequence, or attention_varlen over its
    documents cu; mask and bias per key, (1|Hkv, L)."""
    from dmattn_ops import reference

    if cu is None:
        o = reference.attention(q[None], k[None], v[None], mask[None, :, None],
                                bias[None, :, None], sinks=sinks, **kw)  # fmt: skip
        return o[0]
    t = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    return reference.attention_varlen(q, k, v, t, t, longest, longest, mask, bias, sinks=sinks,
                                      **kw)  # fmt: skip


def _gpu_band_worker(rank: int, world: int, rendezvous: str, failures) -> None:
    """On NCCL in bf16: ring_attention with packed documents, windows and sinks (the varlen
    blocks, the cut blocks and the stopped ring on GPUs) against the float64 oracle on the
    whole sequence, within twice PyTorch's own bf16 error (the oracle run in bf16)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import assert_close, low_precision_bound

    from dmattn_ops import distributed as cp

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        length, h, hkv, d = 64 * 2 * world, 4, 2, 64
        n = length // world  # a rank's rows
        docs = [0, 37, 38, n + 5, length - 9]  # one straddles two ranks; rows past the last
        cases = [
            # (layout, is_causal, window, cu_seqlens, sinks)
            ("zigzag", True, (-1, -1), docs, True),
            ("contiguous", True, (n // 2 + 3, 0), docs, False),
            ("contiguous", False, (-1, 9), docs, True),
            ("zigzag", True, (40, -1), None, True),
            ("contiguous", True, (n - 1, -1), None, False),  # the ring stops after one step
            ("zigzag", False, (7, 30), None, False),
        ]
        for layout, is_causal, window, cu, with_sinks in cases:
            q, k, v, bias, mask, w, sinks = _packed_inputs(length, h, hkv, d, seed=5)
            sinks = sinks if with_sinks else None
            kw = dict(is_causal=is_causal, window_size=window)

            results = []
            for dtype in (torch.float64, torch.bfloat16):
                # Sinks in float32 beside bf16 (as GPT-OSS keeps them): dsinks, a sum over
                # ranks, is then not rounded to bf16 on each.
                leaves = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v, bias)]
                if with_sinks:
                    low = torch.float32 if dtype == torch.bfloat16 else dtype
                    leaves.append(sinks.to(low, copy=True).requires_grad_())
                out = _band_oracle(*leaves[:4], mask, leaves[4] if with_sinks else None, cu, kw)
                (out.double() * w).sum().backward()
                results.append([out.detach()] + [t.grad for t in leaves])

            def part(t, dim, layout=layout):
                return cp.shard(t.cuda(), dim, layout=layout)

            # The dense layout with one batch row: (1, L/R, H, D), per-key (1, H|1, 1, L/R).
            local = [part(t.bfloat16()[None], 1).requires_grad_() for t in (q, k, v)]
            local_bias = part(bias.bfloat16()[None, :, None], 3).requires_grad_()
            local_sinks = sinks.cuda().float().requires_grad_() if with_sinks else None
            cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
            out = cp.ring_attention(*local, part(mask[None, :, None], 3), local_bias,
                                    layout=layout, sinks=local_sinks, cu_seqlens=cu_t,
                                    **kw)  # fmt: skip
            (out * part(w.bfloat16()[None], 1)).sum().backward()
            got = [cp.unshard(out.detach(), 1, layout=layout)[0]]
            got += [cp.unshard(t.grad, 1, layout=layout)[0] for t in local]
            got.append(cp.unshard(local_bias.grad, 3, layout=layout)[0, :, 0])
            if with_sinks:
                dsinks = local_sinks.grad.clone()
                dist.all_reduce(dsinks)  # each rank's rows' share
                got.append(dsinks)
            what = f"{layout} causal={is_causal} window={window} docs={cu} sinks={with_sinks}"
            names = ("out", "dq", "dk", "dv", "dbias", "dsinks")
            for name, a, e, e_lp in zip(names, got, *results):
                bound = low_precision_bound(e, e_lp.double(), torch.bfloat16)
                assert_close(a.cpu().double(), e, bound, f"{what} {name}")
    except Exception:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_with_documents_windows_and_sinks_on_gpus_in_bf16(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    _spawn_worker(_gpu_band_worker, world, tmp_path)


def test_shard_and_unshard_refuse_lengths_that_do_not_divide(tmp_path):
    from dmattn_ops import distributed as cp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        x = torch.arange(10.0).view(1, 10)
        assert torch.equal(cp.unshard(cp.shard(x, 1), 1), x)
        with pytest.raises(ValueError, match="do not divide into 2 chunks"):
            cp.shard(torch.zeros(1, 5), 1)
        with pytest.raises(ValueError, match="must be per key"):
            q = torch.zeros(1, 4, 2, 8)
            cp.ring_attention(q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    finally:
        dist.destroy_process_group()


def _unequal_worker(rank: int, world: int, rendezvous: str, failures) -> None:
    from dmattn_ops import distributed as cp

    with _process_group(rank, world, rendezvous, failures):
        # No refused call may start a transfer (a peer would wait for it): the ranks' own
        # blocks run while they agree, their exchanges only after.
        started = []
        p2p = cp.dist.batch_isend_irecv
        cp.dist.batch_isend_irecv = lambda ops: started.append(len(ops)) or p2p(ops)
        rows = 4 if rank == 0 else 6
        q = torch.randn(1, rows, 2, 8)
        try:
            cp.ring_attention(q, q[:, :, :1], q[:, :, :1], layout="contiguous")
        except ValueError as e:
            assert "every rank must hold the same shapes" in str(e), str(e)
            assert "rank 0: query (1, 4, 2, 8)" in str(e) and "rank 1: query (1, 6, 2, 8)" in str(e)
        else:
            raise AssertionError("unequal lengths were accepted")
        # A call only one rank refuses raises on both, instead of leaving the other waiting.
        mask = torch.ones(1, 1, 1, 4, dtype=torch.bool)
        if rank == 1:
            mask = mask.float()  # not bool
        q = torch.randn(1, 4, 2, 8)
        try:
            cp.ring_attention(q, q, q, mask, layout="contiguous")
        except (TypeError, ValueError) as e:
            assert rank == 1 or "rank(s) [1] refused" in str(e), str(e)
        else:
            raise AssertionError("a refused call ran")
        cp.dist.batch_isend_irecv = p2p
        assert not started, f"a refused call started {started} transfers"
        # A group whose backend takes no CPU tensors (NCCL's, as it reports itself): the
        # agreement runs on a gloo group over the same ranks, made at the first call, and
        # refuses as before; a call all ranks accept runs.
        group = dist.new_group([0, 1])
        backend = cp.dist.get_backend
        cp.dist.get_backend = lambda g=None: "nccl" if g is group else backend(g)
        try:
            q = torch.randn(1, 4 if rank == 0 else 6, 2, 8)
            try:
                cp.ring_attention(q, q[:, :, :1], q[:, :, :1], group=group, layout="contiguous")
            except ValueError as e:
                assert "every rank must hold the same shapes" in str(e), str(e)
            else:
                raise AssertionError("unequal lengths were accepted")
            host = cp._HOST_GROUPS[group]
            assert host is not group and dist.get_process_group_ranks(host) == [0, 1]
            q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
            out = cp.ring_attention(q, q, q, group=group, layout="contiguous")
            assert out.shape == q.shape and torch.isfinite(out).all()
        finally:
            cp.dist.get_backend = backend


def test_ring_attention_refuses_unequal_lengths_on_every_rank(tmp_path):
    _spawn_worker(_unequal_worker, 2, tmp_path)


def _documents(length: int) -> list[list[int]]:
    """cu_seqlens lists over a packed sequence of `length`: a one-token document, an empty one,
    documents straddling chunks and ranks, rows past the last document; one document; many."""
    third = length // 3
    return [
        [0, 1, third + 1, third + 1, length - 5, length - 3],
        [0, length],
        sorted({*range(0, length, 5), length}),
    ]


def _documents_worker(rank: int, world: int, rendezvous: str, failures) -> None:
    """ring_attention with cu_seqlens equals attention_varlen over the whole packed sequence
    (float64, dmattn_ops on the CPU): output and every gradient, both layouts, causal or not,
    with a per-key mask and bias and without; the packed (L/R, H, D) layout too."""
    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import assert_close, float64_grad_bound

    import dmattn_ops
    from dmattn_ops import distributed as cp

    with _process_group(rank, world, rendezvous, failures):
        length, h, hkv, d = 4 * world * 3, 4, 2, 8
        q, k, v, bias, mask, w, sinks = _packed_inputs(length, h, hkv, d, seed=11)
        sinks[1] = float("-inf")  # no sink for that head
        for docs in _documents(length):
            cu = torch.tensor(docs, dtype=torch.int32)
            longest = max(b - a for a, b in itertools.pairwise(docs))
            n = length // (2 * world)  # a zigzag chunk
            for layout, is_causal, operands, packed, with_sinks, window in (
                ("zigzag", True, True, False, False, (-1, -1)),
                ("zigzag", False, True, True, True, (-1, -1)),
                ("contiguous", True, False, True, True, (-1, -1)),
                ("contiguous", False, True, False, False, (-1, -1)),
                ("zigzag", True, True, False, True, (3, -1)),  # a few keys back
                ("contiguous", True, True, True, False, (n + 2, 0)),  # across a chunk's end
                ("zigzag", False, False, False, False, (2, n + 1)),
                ("contiguous", False, True, False, True, (-1, 1)),
            ):  # fmt: skip
                m, b = (mask, bias) if operands else (None, None)
                whole = [t.clone().requires_grad_() for t in (q, k, v)]
                whole_b = b.clone().requires_grad_() if b is not None else None
                whole_s = sinks.clone().requires_grad_() if with_sinks else None
                want, lse = dmattn_ops.attention_varlen(
                    *whole, cu, cu, longest, longest, m, whole_b, is_causal=is_causal,
                    return_lse=True, sinks=whole_s, window_size=window,
                )  # fmt: skip
                (want * w).sum().backward()
                wanted = [want.detach()] + [t.grad for t in whole]
                wanted += [whole_b.grad] if b is not None else []

                def part(t, dim, layout=layout):
                    return None if t is None else cp.shard(t, dim, layout=layout)

                # The packed layout as it is, or the dense one with one batch row.
                dims = (0, 1) if packed else (1, 3)
                lift = (lambda t: t) if packed else (lambda t: t[None])
                lift_keys = (lambda t: t) if packed else (lambda t: t[None, :, None])
                local = [part(lift(t), dims[0]).requires_grad_() for t in (q, k, v)]
                local_b = part(lift_keys(b), dims[1]).requires_grad_() if b is not None else None
                local_m = part(lift_keys(m), dims[1]) if m is not None else None
                local_s = sinks.clone().requires_grad_() if with_sinks else None
                out = cp.ring_attention(*local, local_m, local_b, layout=layout,
                                        is_causal=is_causal, cu_seqlens=cu, sinks=local_s,
                                        window_size=window)  # fmt: skip
                (out * part(lift(w), dims[0])).sum().backward()
                got = [cp.unshard(out.detach(), dims[0], layout=layout)]
                got += [cp.unshard(t.grad, dims[0], layout=layout) for t in local]
                if b is not None:
                    got.append(cp.unshard(local_b.grad, dims[1], layout=layout))
                names = ["out", "dq", "dk", "dv"] + (["dbias"] if b is not None else [])
                if with_sinks:
                    dsinks = local_s.grad.clone()
                    dist.all_reduce(dsinks)  # each rank's rows' share
                    got.append(dsinks)
                    wanted.append(whole_s.grad)
                    names.append("dsinks")
                what = f"docs {docs} {layout} causal={is_causal} window={window} sinks={with_sinks}"
                for name, a, e in zip(names, got, wanted):
                    a = (
                        a
                        if packed or name == "dsinks"
                        else (a[0, :, 0] if name == "dbias" else a[0])
                    )
                    assert_close(a, e, float64_grad_bound(e, lse[None]), f"{what} {name}")
        # Compiled whole (the ring is one op taking cu_seqlens as a tensor): no graph break,
        # the same output as eager.
        cu = torch.tensor(_documents(length)[0], dtype=torch.int32)
        local = [cp.shard(t, 0) for t in (q, k, v)]

        def ring(q, k, v):
            return cp.ring_attention(q, k, v, is_causal=True, cu_seqlens=cu,
                                     group=cp._group_name(None))  # fmt: skip

        compiled = torch.compile(ring, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(*local), ring(*local), rtol=0, atol=0)
        # Documents the ranks disagree on, or past the sequence, raise on every rank.
        local = cp.shard(q, 0)
        for bad, match in (
            (torch.tensor([0, 3 + rank], dtype=torch.int32), "the same cu_seqlens"),
            (torch.tensor([0, length + 1], dtype=torch.int32), "end at most"),
        ):  # fmt: skip
            try:
                cp.ring_attention(local, local, local, cu_seqlens=bad)
            except ValueError as e:
                assert match in str(e) or "refused" in str(e), str(e)
            else:
                raise AssertionError(f"cu_seqlens {bad.tolist()} was accepted")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_with_packed_documents_equals_attention_varlen(world, tmp_path):
    _spawn_worker(_documents_worker, world, tmp_path)


def _lowest_index_topk(bias, window, mask):
    """masks.topk_mask's selection with ties to the lowest key indices, on the whole row (the
    rule distributed.topk_mask follows; torch.topk on one rank breaks ties as it pleases)."""
    from dmattn_ops.masks import rank_key

    shape = torch.broadcast_shapes(bias.shape, mask.shape) if mask is not None else bias.shape
    key = rank_key(bias.expand(shape), mask.expand(shape) if mask is not None else None)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    chosen = torch.zeros(shape, dtype=torch.bool).scatter(-1, order[..., :window], True)
    return chosen & mask if mask is not None else chosen


def _topk_worker(rank: int, world: int, rendezvous: str, failures) -> None:
    """distributed.topk_mask on this rank's columns equals the whole row's top-k, for both
    layouts, windows below, across and above one rank's columns, with a padding mask, and with
    ties (values from a short list) that must go to the lowest global indices."""
    from dmattn_ops import distributed as cp
    from dmattn_ops import masks

    with _process_group(rank, world, rendezvous, failures):
        length = 8 * world
        g = torch.Generator().manual_seed(3)  # the same whole tensors on every rank
        distinct = torch.randn(2, 3, 1, length, generator=g, dtype=torch.float64)
        tied = torch.randint(0, 3, (2, 3, 1, length), generator=g).double()
        pad = torch.rand(2, length, generator=g) < 0.8
        for layout in ("zigzag", "contiguous"):
            for window in (0, 1, 3, length // world + 1, length // 2, length - 1, length + 5):
                for bias, mask in ((distinct, None), (distinct, pad), (tied, None), (tied, pad)):
                    local_mask = None if mask is None else cp.shard(mask, 1, layout=layout)
                    got = cp.topk_mask(cp.shard(bias, 3, layout=layout), window, local_mask,
                                       layout=layout)  # fmt: skip
                    got = cp.unshard(got, 3, layout=layout)
                    m4 = None if mask is None else mask[:, None, None, :]
                    want = _lowest_index_topk(bias, min(window, length), m4)
                    what = f"{layout} window={window} ties={bias is tied} pad={mask is not None}"
                    assert torch.equal(got, want), what
                    if bias is distinct:  # without ties, exactly masks.topk_mask's selection
                        assert torch.equal(got, masks.topk_mask(bias, window, mask)), what


def _layer_worker(rank: int, world: int, rendezvous: str, failures) -> None:
    """A DynamicMaskAttention layer put in context-parallel mode (distributed.parallelize) and
    fed this rank's rows equals the same layer on the whole sequence: output, the input's
    gradient, and every parameter's (summed over ranks), A and dt_proj included."""
    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import assert_close

    from dmattn_ops import distributed as cp
    from dmattn_ops.nn import DynamicMaskAttention

    with _process_group(rank, world, rendezvous, failures):
        for layout, window, causal in (("zigzag", 5, True), ("contiguous", 9, True),
                                       ("zigzag", 7, False)):  # fmt: skip
            torch.manual_seed(0)  # the same weights and input on every rank
            layer = DynamicMaskAttention(32, 4, 2, window=window, is_causal=causal).double()
            x = torch.randn(2, 6 * world, 32, dtype=torch.float64)
            w = torch.randn(2, 6 * world, 32, dtype=torch.float64)
            whole_x = x.clone().requires_grad_()
            want = layer(whole_x)
            (want * w).sum().backward()
            wanted = {name: p.grad.clone() for name, p in layer.named_parameters()}
            layer.zero_grad()
            cp.parallelize(layer, layout=layout)
            local_x = cp.shard(x, 1, layout=layout).requires_grad_()
            out = layer(local_x)
            (out * cp.shard(w, 1, layout=layout)).sum().backward()
            what = f"{layout} window={window} causal={causal}"
            got_out = cp.unshard(out.detach(), 1, layout=layout)
            assert_close(got_out, want.detach(), 1e-12 * want.abs().max(), f"{what} out")
            got_dx = cp.unshard(local_x.grad, 1, layout=layout)
            assert_close(got_dx, whole_x.grad, 1e-12 * whole_x.grad.abs().max(), f"{what} dx")
            for name, p in layer.named_parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad)
                bound = 1e-12 * wanted[name].abs().max() + 1e-300
                assert_close(grad, wanted[name], bound, f"{what} d{name}")
            cp.parallelize(layer, layout=None)
            assert layer.context_parallel is None


def _last_step_with_work(world: int, layout: str, length: int, is_causal: bool, window) -> int:
    """By brute force over positions: the last ring step s at which some rank's queries see a
    key of the rank s before it (steps after it carry no work, so the ring stops there)."""
    n_chunks = 2 * world if layout == "zigzag" else world
    n = length // n_chunks

    def positions(r):
        ids = (r, n_chunks - 1 - r) if layout == "zigzag" else (r,)
        return [c * n + i for c in ids for i in range(n)]

    lo = -math.inf if window[0] < 0 else -window[0]
    hi = math.inf if window[1] < 0 else window[1]
    hi = min(hi, 0) if is_causal else hi
    last = 0
    for step in range(1, world):
        for r in range(world):
            keys = positions((r - step) % world)
            if any(lo <= j - i <= hi for i in positions(r) for j in keys):
                last = step
    return last


def _window_worker(rank: int, world: int, rendezvous: str, failures) -> None:
    """ring_attention with window_size and sinks equals attention on the whole sequence with
    them: windows inside one chunk, across chunks and ranks, one-sided and two-sided, causal or
    not, with a per-key mask and bias, sinks (one of them -inf) with or without a window (out
    and every gradient, dsinks summed over ranks; float64)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import assert_close, float64_grad_bound

    import dmattn_ops
    from dmattn_ops import distributed as cp
    from dmattn_ops import reference

    # Every transfer the ring makes, to compare with the steps that carry work.
    transfers = []
    exchange = cp._Ring.exchange

    def counted(ring, tensors, to=1):
        transfers.append(to)
        return exchange(ring, tensors, to)

    cp._Ring.exchange = counted

    with _process_group(rank, world, rendezvous, failures):
        chunk = 4
        length = 2 * world * chunk
        cases = [
            ("zigzag", True, (2, -1), False),  # a few keys back: most blocks are skipped
            ("zigzag", True, (chunk + 1, 0), False),  # across one chunk boundary
            ("contiguous", True, (length // 2, -1), False),
            ("zigzag", False, (3, 2), False),
            ("contiguous", False, (-1, 1), False),
            ("zigzag", False, (0, chunk * 2 + 1), False),
            ("contiguous", False, (length, length), False),  # wider than the sequence
            ("zigzag", True, (-1, -1), True),
            ("contiguous", True, (3, 0), True),
            ("zigzag", False, (2, 5), True),
        ]
        for layout, is_causal, window, with_sinks in cases:
            g = torch.Generator().manual_seed(11)
            b, h, hkv, d = 2, 4, 2, 8
            q = torch.randn(b, length, h, d, generator=g, dtype=torch.float64)
            k = torch.randn(b, length, hkv, d, generator=g, dtype=torch.float64)
            v = torch.randn(b, length, hkv, d, generator=g, dtype=torch.float64)
            bias = torch.randn(b, hkv, 1, length, generator=g, dtype=torch.float64)
            mask = torch.rand(b, 1, 1, length, generator=g) < 0.7
            w = torch.randn(b, length, h, d, generator=g, dtype=torch.float64)
            sinks = None
            if with_sinks:
                sinks = torch.randn(h, generator=g, dtype=torch.float64)
                sinks[1] = float("-inf")  # no sink for that head
            kw = dict(is_causal=is_causal, window_size=window)
            whole = [t.clone().requires_grad_() for t in (q, k, v, bias)]
            whole_sinks = sinks.clone().requires_grad_() if with_sinks else None
            want = dmattn_ops.attention(*whole[:3], mask, whole[3], sinks=whole_sinks, **kw)
            (want * w).sum().backward()
            _, lse = reference.attention(q, k, v, mask, bias, return_lse=True, sinks=sinks, **kw)
            wanted = [want.detach()] + [t.grad for t in whole]

            local = [cp.shard(t, 1, layout=layout).requires_grad_() for t in (q, k, v)]
            local_bias = cp.shard(bias, 3, layout=layout).requires_grad_()
            local_sinks = sinks.clone().requires_grad_() if with_sinks else None
            transfers.clear()
            out = cp.ring_attention(*local, cp.shard(mask, 3, layout=layout), local_bias,
                                    layout=layout, sinks=local_sinks, **kw)  # fmt: skip
            (out * cp.shard(w, 1, layout=layout)).sum().backward()
            # K/V travel `last` steps forward and backward, and the gradients once more.
            last = _last_step_with_work(world, layout, length, is_causal, window)
            assert len(transfers) == 2 * last + (last + 1 if last else 0), (last, transfers)
            got = [cp.unshard(out.detach(), 1, layout=layout)]
            got += [cp.unshard(t.grad, 1, layout=layout) for t in local]
            got.append(cp.unshard(local_bias.grad, 3, layout=layout))
            if with_sinks:
                dsinks = local_sinks.grad.clone()
                dist.all_reduce(dsinks)  # each rank's rows' share
                got.append(dsinks)
                wanted.append(whole_sinks.grad)
            what = f"{layout} causal={is_causal} window={window} sinks={with_sinks}"
            for name, a, e in zip(("out", "dq", "dk", "dv", "dbias", "dsinks"), got, wanted):
                assert_close(a, e, float64_grad_bound(e, lse), f"{what} {name}")


def _compiled_worker(rank: int, world: int, rendezvous: str, failures) -> None:
    """A model of two DMA layers in context-parallel mode compiles with fullgraph=True: the
    global top-k and the ring are ops taking the group by name, one node each (Dynamo broke a
    layer's graph 15 times when it traced them, 2 when they ran compiler.disable'd), and the
    compiled model's output and gradients equal the eager model's, with the ring's ops in
    the forward and backward graphs; under Inductor too."""
    import torch._dynamo as dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from dmattn_ops import distributed as cp
    from dmattn_ops.nn import DynamicMaskAttention

    with _process_group(rank, world, rendezvous, failures):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *(DynamicMaskAttention(32, 4, 2, window=5).double() for _ in range(2))
        )
        cp.parallelize(model)
        x = cp.shard(torch.randn(2, 6 * world, 32, dtype=torch.float64), 1)
        explained = dynamo.explain(model)(x)
        assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
        graphs = []

        def keep(gm, _):
            graphs.append(gm)
            return make_boxed_func(gm)

        dynamo.reset()
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep), fullgraph=True)
        runs = []
        for run in (model, compiled):
            model.zero_grad()
            leaf = x.clone().requires_grad_()
            out = run(leaf)
            out.square().sum().backward()
            runs.append([out.detach(), leaf.grad, *(p.grad for p in model.parameters())])
        for eager, got in zip(*runs):
            torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-12)
        targets = [str(n.target) for g in graphs for n in g.graph.nodes]
        for op in ("cp_topk_select", "ring_attention_forward", "ring_attention_backward"):
            assert sum(f"dmattn.{op}" in t for t in targets) == len(model), (op, targets)
        # The default backend: Inductor checks each op's output strides against its fake
        # kernel's at run time (the layer's bias is transposed: cp_topk_select's mask and the
        # ring's dbias once followed it while their fakes said contiguous).
        dynamo.reset()
        inductor = torch.compile(model, fullgraph=True)
        model.zero_grad()
        leaf = x.clone().requires_grad_()
        out = inductor(leaf)
        out.square().sum().backward()
        got = [out.detach(), leaf.grad, *(p.grad for p in model.parameters())]
        for eager, g in zip(runs[0], got):
            torch.testing.assert_close(g, eager, rtol=1e-10, atol=1e-10)

        # The ops' schemas, fake kernels and autograd registration (every rank runs the same
        # sequence of calls, as the ring needs).
        name = cp._group_name(None)
        ring = cp._ring_spec(None, "zigzag", 0.3, True, 0.0, False, (-1, -1))
        q, k, v = (torch.randn(2, 4, h, 8, dtype=torch.float64, requires_grad=True)
                   for h in (4, 2, 2))  # fmt: skip
        bias = torch.randn(2, 2, 1, 4, dtype=torch.float64, requires_grad=True)
        sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
        mask = torch.rand(2, 2, 1, 4) > 0.3
        args = (q, k, v, mask, bias, sinks, None, ring)
        torch.library.opcheck(torch.ops.dmattn.ring_attention_forward.default, args)
        docs = torch.tensor([0, 3, 4 * world - 1], dtype=torch.int32)  # packed documents
        args = (q[:1], k[:1], v[:1], mask[:1], bias[:1], None, docs, ring)
        torch.library.opcheck(torch.ops.dmattn.ring_attention_forward.default, args)
        torch.library.opcheck(torch.ops.dmattn.cp_topk_select.default,
                              (bias.detach(), mask, 3, name, "zigzag"))  # fmt: skip
        # A transposed bias, as the DMA layer makes it: the outputs keep the fakes' strides.
        bias_t = torch.randn(2, 4, 2, dtype=torch.float64).transpose(1, 2).unsqueeze(2)
        torch.library.opcheck(torch.ops.dmattn.cp_topk_select.default,
                              (bias_t, None, 3, name, "zigzag"))  # fmt: skip
        args = (q, k, v, mask, bias_t.requires_grad_(), sinks, None, ring)
        torch.library.opcheck(torch.ops.dmattn.ring_attention_forward.default, args)


def _watched(rank: int, worker, *args) -> None:
    """worker(rank, *args); a rank still running after DMATTN_TEST_RANK_DUMP_S seconds (when
    set: the GPU check sets it) prints every thread's stack to stderr, so that a ring stuck in
    a transfer shows where."""
    seconds = float(os.environ.get("DMATTN_TEST_RANK_DUMP_S", "0"))
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds)
    worker(rank, *args)
    # A rank whose checks passed, its process group destroyed, ends here without the
    # interpreter's finalization: there gloo's worker threads may still release tensors that
    # hold Python references, and a rank then aborted now and then ("terminate called without
    # an active exception", SIGABRT, after its test had passed: CI under torch 2.15 in session
    # 55 and under 2.13 in session 56, with the barrier before teardown already in place;
    # pytorch/pytorch#179291 describes the finalization crash). A failing rank raises above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn_worker(worker, world: int, tmp_path, *extra) -> None:
    """worker(rank, world, rendezvous, failures, *extra) in `world` spawned processes; a rank's
    failure fails the test with every rank's traceback. The ranks run without the Triton
    interpreter (the CPU path)."""
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    env = {"TRITON_INTERPRET": os.environ.pop("TRITON_INTERPRET", None)}
    try:
        mp.start_processes(_watched, args=(worker, world, str(tmp_path / "rdv"), failures,
                                           *extra), nprocs=world, start_method="spawn")  # fmt: skip
    except mp.ProcessRaisedException:
        messages = []
        while not failures.empty():
            messages.append(failures.get())
        pytest.fail("\n".join(messages) or "a rank failed")
    finally:
        if env["TRITON_INTERPRET"] is not None:
            os.environ["TRITON_INTERPRET"] = env["TRITON_INTERPRET"]


@pytest.mark.parametrize("world", [2, 3])
def test_topk_mask_selects_over_the_whole_sequence(world, tmp_path):
    _spawn_worker(_topk_worker, world, tmp_path)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_dma_layer_equals_the_whole_sequence_layer(world, tmp_path):
    _spawn_worker(_layer_worker, world, tmp_path)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_with_windows_and_sinks_equals_attention(world, tmp_path):
    _spawn_worker(_window_worker, world, tmp_path)


def test_sharded_dma_model_compiles_fullgraph(tmp_path):
    _spawn_worker(_compiled_worker, 2, tmp_path)


def _block_entries(block) -> list[tuple[int, int]]:
    """The (row, key) entries, in the block's local indices, that its op call computes: the op's
    band aligned bottom-right over the block's slices."""
    nq, nk = block.q1 - block.q0, block.k1 - block.k0
    left, right = block.window
    got = []
    for i in range(nq):
        for j in range(nk):
            d = j - i - (nk - nq)
            if block.is_causal:
                ok = d <= 0
            else:
                ok = (left < 0 or d >= -left) and (right < 0 or d <= right)
            if ok:
                got.append((block.q0 + i, block.k0 + j))
    return got


def test_ring_steps_compute_each_visible_entry_once():
    """_Ring.pairs: the calls of each ring step (every rank, every source rank's keys, both
    layouts, causal or not, windows) compute exactly the (row, key) entries whose global
    positions see each other, and each of them once: zigzag's whole-band steps as one call
    (_zigzag_block) or per pair of chunks (whole=False, the backward's), the rest per pair.
    Brute force over global positions."""
    from dmattn_ops import distributed as cp

    n = 3  # rows per chunk
    for world in (1, 2, 3, 4):
        for layout in cp.LAYOUTS:
            rows = n * len(cp._chunk_ids(layout, 0, world))
            for is_causal in (True, False):
                for window in ((-1, -1), (2, 0), (-1, 4), (5, 2), (0, -1)):
                    ring = cp._Ring(None, world, 0, layout, 1.0, is_causal, 0.0, False, window)
                    lo, hi = ring.band()
                    whole_band = window[0] < 0 and (is_causal or window[1] < 0)
                    # Global position of each local row, per rank.
                    pos = [[ids[x // n] * n + x % n for x in range(rows)]
                           for ids in (cp._chunk_ids(layout, r, world) for r in range(world))]  # fmt: skip
                    for rank in range(world):
                        for src in range(world):
                            want = {(i, j) for i in range(rows) for j in range(rows)
                                    if lo <= pos[src][j] - pos[rank][i] <= hi}  # fmt: skip
                            what = (world, layout, is_causal, window, rank, src)
                            for whole in (True, False):
                                got = [e for b in ring.pairs(src, rows, rank=rank, whole=whole)
                                       for e in _block_entries(b)]  # fmt: skip
                                assert len(got) == len(set(got)), (*what, whole)
                                assert set(got) == want, (*what, whole)
                            if layout == "zigzag" and whole_band:
                                assert len(list(ring.pairs(src, rows, rank=rank))) == 1, what


def test_pair_call_computes_exactly_the_visible_entries_of_a_block():
    """distributed._pair_call: nq queries at p + i, nk keys at p + offset + j, keys visible where
    key - query lies in [lo, hi]. The rows and keys it keeps, under the op's bottom-right band
    (is_causal, or window_size over the slices), see exactly the visible (i, j), and nothing
    when it returns None. Brute force over small blocks, every offset, bounded and unbounded
    sides."""
    from dmattn_ops import distributed as cp

    inf = math.inf
    sides = (-inf, -5, -2, -1, 0, 1, 3, inf)
    for nq in range(1, 5):
        for nk in range(1, 5):
            for offset in range(-6, 7):
                for lo in sides:
                    for hi in sides:
                        if lo > hi or lo == inf or hi == -inf:
                            continue
                        want = {(i, j) for i in range(nq) for j in range(nk)
                                if lo <= j - i + offset <= hi}  # fmt: skip
                        call = cp._pair_call((lo, hi), offset, nq, nk)
                        got = set()
                        if call is not None:
                            (q0, q1), (k0, k1), causal, window = call
                            got = set(_block_entries(cp._Block(q0, q1, k0, k1, causal, window)))
                        assert got == want, (nq, nk, offset, lo, hi, call)
                        assert call is None or want, (nq, nk, offset, lo, hi, call)
