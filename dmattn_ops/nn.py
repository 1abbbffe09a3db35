"""Modules built on the dmattn ops."""

from __future__ import annotations

import torch

from dmattn_ops.api import attention
from dmattn_ops.core.switches import switch
from dmattn_ops.dt_bias import dt_bias_values
from dmattn_ops.masks import select_topk


class DynamicMaskAttention(torch.nn.Module):
    r"""Dynamic Mask Attention layer (Shi et al. 2025; the attention of the Doge models).

    q/k/v/o projections with GQA; a learned bias per KV head and key computed from the values,

        bias[b, g, 0, j] = A[g] * softplus(dt_proj(V[b, j])[g])        # (B, Hkv, 1, L)

    which is added to the logits (and trained through the attention), and a top-``window`` mask
    of that bias (no gradient) that every query of the KV group shares. With causal masking a
    query sees the selected keys at or before its position.

    Args:
        hidden_size: model width.
        num_heads: query heads H.
        num_kv_heads: key/value heads Hkv (H % Hkv == 0); defaults to H.
        head_dim: defaults to hidden_size // num_heads.
        window: keys kept per KV head (top-k of the bias).
        is_causal: bottom-right causal masking.
        softcap: logit soft-capping (0 disables).
        backend: passed to :func:`dmattn_ops.attention`.

    Shapes: ``forward(x)`` takes (B, L, hidden_size) and returns the same shape.

    Context parallelism: after ``dmattn_ops.distributed.parallelize(model, group)`` each rank
    passes its rows of the sequence, (B, L/R, hidden_size) as ``distributed.shard`` cuts them;
    the layer then picks its top-``window`` keys over the whole sequence
    (``distributed.topk_mask``) and attends through ``distributed.ring_attention``
    (``backend`` is not used there).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        window: int = 2048,
        is_causal: bool = True,
        softcap: float = 0.0,
        backend: str = "auto",
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"DynamicMaskAttention: num_heads={num_heads} must be a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.window, self.is_causal, self.softcap, self.backend = (
            window,
            is_causal,
            softcap,
            backend,
        )
        kv_width = num_kv_heads * self.head_dim
        self.q_proj = torch.nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden_size, kv_width, bias=False)
        self.v_proj = torch.nn.Linear(hidden_size, kv_width, bias=False)
        self.o_proj = torch.nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.dt_proj = torch.nn.Linear(kv_width, num_kv_heads, bias=True)
        self.A = torch.nn.Parameter(torch.ones(num_kv_heads))
        # dmattn_ops.distributed.ContextParallel when the sequence is sharded across ranks
        # (dmattn_ops.distributed.parallelize), else None.
        self.context_parallel = None

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, window={self.window}, is_causal={self.is_causal}, "
            f"softcap={self.softcap}, backend={self.backend!r}"
        )

    def dynamic_mask(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask, bias) of values v (B, L, Hkv, head_dim): the learned bias (B, Hkv, 1, L) in
        v's dtype and its top-``window`` keys as a bool mask of the same shape, what
        :meth:`forward` passes to the attention."""
        mask, bias, _ = self._selection(v, direct=False)
        return mask, bias

    def _selection(self, v: torch.Tensor, direct: bool) -> tuple:
        """(mask, bias, values): dynamic_mask's pair, and the values (v's shape) the attention
        takes. direct: the mask goes to this library's ops alone (not to flex), so a compiled
        graph may pass the selection kernel's buffer on (masks.select_topk), and the bias op
        hands the values on (dt_bias_values: v's two gradients summed in its backward
        kernel)."""
        # [B, Hkv, 1, L] in v's dtype, computed in float32 or wider and rounded once. The op
        # (on unless DMATTN_DT_BIAS=0) is not for a bias flex's score_mod captures: its
        # compiled graph would read the traced kernel's buffer as unwritten
        # (registration/inductor.py).
        kernel = direct and switch("DMATTN_DT_BIAS", True)
        weight, c = self.dt_proj.weight, self.dt_proj.bias
        bias, values = dt_bias_values(v.flatten(2), weight, c, self.A, kernel=kernel)
        values = values.view(v.shape)
        cp = self.context_parallel
        if cp is None:
            return select_topk(bias, self.window, direct=direct), bias, values
        from dmattn_ops import distributed

        # v holds this rank's rows: the top keys are chosen over the whole sequence.
        mask = distributed.topk_mask(bias, self.window, group=cp.group_name, layout=cp.layout)
        return mask, bias, values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, length, self.num_kv_heads, self.head_dim)
        mask, bias, v = self._selection(v, direct=self.backend != "flex")
        cp = self.context_parallel
        if cp is not None:
            from dmattn_ops import distributed

            out = distributed.ring_attention(
                q, k, v, mask, bias, group=cp.group_name, is_causal=self.is_causal,
                softcap=self.softcap, layout=cp.layout,
            )  # fmt: skip
            return self.o_proj(out.flatten(2))
        out = attention(
            q, k, v, mask, bias, is_causal=self.is_causal, softcap=self.softcap,
            backend=self.backend,
        )  # fmt: skip
        return self.o_proj(out.flatten(2))
