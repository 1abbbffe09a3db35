"""Every invalid call raises TypeError/ValueError naming the argument, before any kernel runs."""

import expecttest
import pytest
import torch

import dmattn_ops
from dmattn_ops.dispatch import launch, plan


@pytest.fixture(autouse=True)
def no_kernel_may_run(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel ran for an invalid call")

    monkeypatch.setattr(launch, "forward", forbidden)
    monkeypatch.setattr(launch, "backward", forbidden)


def qkv(b=2, lq=5, lk=7, h=4, hkv=2, d=8, dv=8, dtype=torch.float32):
    return (
        torch.randn(b, lq, h, d, dtype=dtype),
        torch.randn(b, lk, hkv, d, dtype=dtype),
        torch.randn(b, lk, hkv, dv, dtype=dtype),
    )


def message(exc_type, fn, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    return str(info.value)


class TestErrors(expecttest.TestCase):
    def check(self, exc_type, expected, *args, **kwargs):
        self.assertExpectedInline(
            message(exc_type, dmattn_ops.attention, *args, **kwargs), expected, skip=1
        )

    def test_rank(self):
        q, k, v = qkv()
        self.check(
            ValueError,
            """dmattn.attention: query must be 4-D (B, Lq, H, D); got shape (5, 4, 8)""",
            q[0],
            k,
            v,
        )
        self.check(
            ValueError,
            """dmattn.attention: key must be 4-D (B, Lk, Hkv, D); got shape (7, 2, 8)""",
            q,
            k[0],
            v,
        )
        self.check(
            ValueError,
            """dmattn.attention: value must be 4-D (B, Lk, Hkv, Dv); got shape (7, 2, 8)""",
            q,
            k,
            v[0],
        )

    def test_not_a_tensor(self):
        q, k, v = qkv()
        self.check(
            TypeError, """dmattn.attention: query must be a torch.Tensor, got list""", [1.0], k, v
        )

    def test_dtypes(self):
        q, k, v = qkv()
        self.check(
            TypeError,
            """dmattn.attention: query must be float16, bfloat16, float32 or float64; got torch.int64""",
            q.long(),
            k,
            v,
        )
        self.check(
            TypeError,
            """dmattn.attention: key dtype torch.float16 differs from query dtype torch.float32""",
            q,
            k.half(),
            v,
        )
        self.check(
            TypeError,
            """dmattn.attention: mask must be a bool tensor, or an int32 row-limit mask; got torch.float32""",
            q,
            k,
            v,
            torch.ones(1, 1, 1, 7),
        )
        self.check(
            TypeError,
            """dmattn.attention: bias dtype must be query's (torch.float16) or torch.float32; got torch.bfloat16""",
            *(t.half() for t in (q, k, v)),
            None,
            torch.ones(1, 1, 1, 7, dtype=torch.bfloat16),
        )

    def test_shapes(self):
        q, k, v = qkv()
        self.check(
            ValueError,
            """dmattn.attention: key must have shape (B, Lk, Hkv, D) = (2, Lk, Hkv, 8) to match query (2, 5, 4, 8); got (2, 7, 2, 6)""",
            q,
            k[..., :6],
            v,
        )
        self.check(
            ValueError,
            """dmattn.attention: value must have shape (B, Lk, Hkv, Dv) = (2, 7, 2, Dv) to match key (2, 7, 2, 8); got (2, 6, 2, 8)""",
            q,
            k,
            v[:, :6],
        )
        q3, k3, v3 = qkv(h=4, hkv=3)
        self.check(
            ValueError,
            """dmattn.attention: the number of query heads H=4 must be a multiple of the number of key/value heads Hkv=3 (query (2, 5, 4, 8), key (2, 7, 3, 8))""",
            q3,
            k3,
            v3,
        )
        qd, kd, vd = qkv(d=264, dv=8)
        self.check(
            ValueError,
            """dmattn.attention: head dims must be at most 256; got D=264 (query/key) and Dv=8 (value)""",
            qd,
            kd,
            vd,
        )

    def test_broadcast(self):
        q, k, v = qkv()
        self.check(
            ValueError,
            """dmattn.attention: mask must be 4-D (B|1, H|Hkv|1, Lq|1, Lk) with B=2, H=4, Hkv=2, Lq=5, Lk=7; got shape (5, 7)""",
            q,
            k,
            v,
            torch.ones(5, 7, dtype=torch.bool),
        )
        self.check(
            ValueError,
            """dmattn.attention: bias of shape (2, 3, 5, 7) does not broadcast to the scores; expected (B|1, H|Hkv|1, Lq|1, Lk) with B=2, H=4, Hkv=2, Lq=5, Lk=7""",
            q,
            k,
            v,
            None,
            torch.ones(2, 3, 5, 7),
        )
        self.check(
            ValueError,
            """dmattn.attention: mask of shape (1, 1, 1, 8) does not broadcast to the scores; expected (B|1, H|Hkv|1, Lq|1, Lk) with B=2, H=4, Hkv=2, Lq=5, Lk=7""",
            q,
            k,
            v,
            torch.ones(1, 1, 1, 8, dtype=torch.bool),
        )

    def test_seqused_k(self):
        q, k, v = qkv()
        self.check(
            TypeError,
            """dmattn.attention: seqused_k must be int32; got torch.int64""",
            q,
            k,
            v,
            seqused_k=torch.tensor([1, 2]),
        )
        self.check(
            ValueError,
            """dmattn.attention: seqused_k must have shape (B,) = (2,); got (3,)""",
            q,
            k,
            v,
            seqused_k=torch.tensor([1, 2, 3], dtype=torch.int32),
        )
        self.check(
            ValueError,
            """dmattn::attention: seqused_k values must lie in [0, Lk=7]; got values from 1 to 8""",
            q,
            k,
            v,
            seqused_k=torch.tensor([1, 8], dtype=torch.int32),
        )
        self.check(
            ValueError,
            """dmattn::attention: seqused_k values must lie in [0, Lk=7]; got values from -1 to 3""",
            q,
            k,
            v,
            seqused_k=torch.tensor([-1, 3], dtype=torch.int32),
        )

    def test_scalars_and_backend(self):
        q, k, v = qkv()
        self.check(
            ValueError,
            """dmattn.attention: softcap must be finite and >= 0 (0 disables it); got -1.0""",
            q,
            k,
            v,
            softcap=-1.0,
        )
        self.check(
            ValueError,
            """dmattn.attention: scale must be finite; got nan""",
            q,
            k,
            v,
            scale=float("nan"),
        )
        self.check(
            TypeError,
            """dmattn.attention: scale must be a float or None; got str""",
            q,
            k,
            v,
            scale="1",
        )
        self.check(
            ValueError,
            """dmattn.attention: backend must be one of ('auto', 'triton', 'flex', 'reference'); got 'cuda'""",
            q,
            k,
            v,
            backend="cuda",
        )

    def test_direct_op_call_validates_too(self):
        q, k, v = qkv()
        msg = message(ValueError, torch.ops.dmattn.attention, q, k, v, None, torch.ones(2, 3, 5, 7))
        self.assertExpectedInline(
            msg,
            """dmattn::attention: bias of shape (2, 3, 5, 7) does not broadcast to the scores; expected (B|1, H|Hkv|1, Lq|1, Lk) with B=2, H=4, Hkv=2, Lq=5, Lk=7""",
        )


def test_devices_must_match():
    if not torch.cuda.is_available():
        q, k, v = qkv()
        meta_k = k.to("meta")
        with pytest.raises(ValueError, match="key is on meta but query is on cpu"):
            dmattn_ops.attention(q, meta_k, v)
    else:
        q, k, v = qkv()
        with pytest.raises(ValueError, match="key is on cuda:0 but query is on cpu"):
            dmattn_ops.attention(q, k.cuda(), v)


def test_backends_that_cannot_run_say_so(monkeypatch):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="backend='triton' supports float16, bfloat16 and float32"):
        dmattn_ops.attention(q.double(), k.double(), v.double(), backend="triton")
    if not torch.cuda.is_available():
        monkeypatch.setattr(plan, "interpreter_on", lambda: False)
        with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
            dmattn_ops.attention(q, k, v, backend="triton")
