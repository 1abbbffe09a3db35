"""vmap rules of the dmattn ops (torch.library.register_vmap): the vmapped dim is folded into
the ops' own batch, so a vmapped call is one launch, never PyTorch's per-sample fallback.

Dense ops: the N samples of a batch of B become a batch of N * B (operands that broadcast over
the batch keep doing so). Varlen ops: the samples' packed rows are concatenated and their
cu_seqlens shifted (see _VarlenFold). Imported by ops.py after the ops are defined.
"""

from __future__ import annotations

import torch

from dmattn_ops.executors import chunked
from dmattn_ops.registration.calls import bind, unbind

# Dense ops: the vmapped dim is folded into the batch dim B, one launch for all of it.


def _fold(t, dim, n: int, b: int, *, keep_broadcast: bool = False):
    """[N, b|1, ...] (or unbatched [b|1, ...]) -> [N * b, ...].

    With keep_broadcast an unbatched operand whose batch dim is 1 stays as it is: it broadcasts
    over the folded batch just as it did over B.
    """
    if t is None:
        return None
    if dim is None:
        if keep_broadcast and t.shape[0] == 1:
            return t
        t = t.expand(n, *t.shape)
    else:
        t = t.movedim(dim, 0)
    return t.expand(n, b, *t.shape[2:]).reshape(n * b, *t.shape[2:])


def _unfold(t: torch.Tensor, n: int, b: int) -> torch.Tensor:
    return t.unflatten(0, (n, b))


def _bound(op, in_dims, args, kwargs):
    """(call, dims): the call's values and vmapped dims by argument name (calls.bind; a dropped
    trailing argument's dim is None)."""
    call = bind(op, args, kwargs)
    dims = {name: None for name in call}
    dims.update(zip(call, in_dims))
    return call, dims


def _batch_size(t: torch.Tensor, dim) -> int:
    """Size of the per-sample batch dim B of t, whose vmapped dim (if any) is at dim."""
    return t.shape[0] if dim is None else t.movedim(dim, 0).shape[1]


def _unbatched_sinks(sinks, dim, op: str):
    """Sinks are per head and shared by the batch a vmapped call folds them into: a sink per
    sample cannot be folded (dsinks per sample, by contrast, is computed below)."""
    if sinks is not None and dim is not None:
        raise NotImplementedError(
            f"{op}: vmap over sinks (a different sinks tensor per sample) is not supported; "
            "vmap over the other inputs with sinks shared (in_dims None), or loop over samples"
        )
    return sinks


def _fold_forward(info, op, in_dims, args, kwargs):
    """A call of attention / attention_forward with the vmapped dim folded into B, and (n, b)
    to unfold the results."""
    call, dims = _bound(op, in_dims, args, kwargs)
    query = call["query"]
    n, b = info.batch_size, _batch_size(query, dims["query"])
    folded = dict(call)
    for name in ("query", "key", "value", "seqused_k"):
        folded[name] = _fold(call[name], dims[name], n, b)
    for name in ("mask", "bias"):
        folded[name] = _fold(call[name], dims[name], n, b, keep_broadcast=True)
    folded["sinks"] = _unbatched_sinks(call["sinks"], dims["sinks"], "dmattn.attention")
    folded["softcap"] = 0.0 if call["softcap"] is None else call["softcap"]
    return unbind(op, folded), n, b


@torch.library.register_vmap("dmattn::attention")
def _attention_vmap(info, in_dims, *args, **kwargs):
    op = torch.ops.dmattn.attention.default
    folded, n, b = _fold_forward(info, op, in_dims, args, kwargs)
    return _unfold(op(*folded), n, b), 0


@torch.library.register_vmap("dmattn::attention_forward")
def _forward_vmap(info, in_dims, *args, **kwargs):
    op = torch.ops.dmattn.attention_forward.default
    folded, n, b = _fold_forward(info, op, in_dims, args, kwargs)
    out, lse, lse_rem = op(*folded)
    return (_unfold(out, n, b), _unfold(lse, n, b), _unfold(lse_rem, n, b)), (0, 0, 0)


@torch.library.register_vmap("dmattn::attention_backward")
def _backward_vmap(info, in_dims, *args, **kwargs):
    op = torch.ops.dmattn.attention_backward.default
    call, dims = _bound(op, in_dims, args, kwargs)
    n, b = info.batch_size, _batch_size(call["query"], dims["query"])
    bias, sinks = call["bias"], call["sinks"]
    sinks = _unbatched_sinks(sinks, dims["sinks"], "dmattn.attention (backward)")
    compute_dbias = call["compute_dbias"] and bias is not None
    # Each vmapped sample needs its own dbias, so a bias shared over the batch is expanded here
    # and its batch dim summed back below.
    folded = dict(call, compute_dbias=compute_dbias, sinks=sinks)
    rows = ("grad_out", "grad_lse", "query", "key", "value", "out", "lse", "lse_rem", "seqused_k")
    for name in rows:
        folded[name] = _fold(call[name], dims[name], n, b)
    folded["mask"] = _fold(call["mask"], dims["mask"], n, b, keep_broadcast=True)
    folded["bias"] = _fold(bias, dims["bias"], n, b, keep_broadcast=not compute_dbias)
    dq, dk, dv, dbias, dsinks = op(*unbind(op, folded))
    grads = (_unfold(dq, n, b), _unfold(dk, n, b), _unfold(dv, n, b))
    if sinks is not None:
        # The op summed dsinks over all samples; each sample's own sum, from its statistics.
        g_out, g_lse, o, stat, stat_rem = (
            None if folded[name] is None else _unfold(folded[name], n, b)
            for name in ("grad_out", "grad_lse", "out", "lse", "lse_rem")
        )
        dsinks = chunked.sinks_grad(sinks, stat, stat_rem, chunked.row_delta(o, g_out, g_lse))
    dsinks_dim = None if sinks is None else 0
    if not compute_dbias:
        return (*grads, dbias, dsinks), (0, 0, 0, None, dsinks_dim)
    dbias = _unfold(dbias, n, b)
    if _batch_size(bias, dims["bias"]) == 1 and b != 1:
        dbias = dbias.float().sum(dim=1, keepdim=True).to(bias.dtype)
    return (*grads, dbias, dsinks), (0, 0, 0, 0, dsinks_dim)


# vmap of the varlen ops: the N vmapped samples become one packed batch of N * B sequences.
# Sample n occupies packed rows [n * T, (n + 1) * T) and its cu_seqlens shift by n * T. cu starts
# at 0, so the flattened (N, B + 1) offsets list every sequence plus, between samples, the rows
# past a sample's last sequence as a sequence of their own: its keys are masked out, so those
# rows get out 0 and lse -inf and their keys no gradient, exactly as rows outside every sequence.


class _VarlenFold:
    """The folded operands of one vmapped varlen call."""

    def __init__(self, n: int, call: dict, dims: dict):
        """call: the bound call; dims: its arguments' vmapped dims, by name."""
        query, key = call["query"], call["key"]
        cu_q, cu_k = call["cu_seqlens_q"], call["cu_seqlens_k"]
        max_q, max_k = call["max_seqlen_q"], call["max_seqlen_k"]
        self.n = n
        self.tq = _per_sample_rows(query, dims["query"])
        self.tk = _per_sample_rows(key, dims["key"])
        self.cu_q = self._offsets(cu_q, dims["cu_seqlens_q"], self.tq)
        self.cu_k = self._offsets(cu_k, dims["cu_seqlens_k"], self.tk)
        ends_k = self.cu_k.view(n, -1)[:, -1] - torch.arange(n, device=key.device) * self.tk
        key_pos = torch.arange(self.tk, device=key.device)
        self.in_sequence = (key_pos[None, :] < ends_k[:, None]).reshape(1, n * self.tk)
        # The sequences between samples are at most T long.
        self.max_q, self.max_k = max(max_q, self.tq), max(max_k, self.tk)

    def _offsets(self, cu, dim, total):
        cu = cu.expand(self.n, *cu.shape) if dim is None else cu.movedim(dim, 0)
        shift = torch.arange(self.n, device=cu.device, dtype=cu.dtype)[:, None] * total
        return (cu + shift).reshape(-1)

    def rows(self, t, dim):
        """(N, total, ...) or unbatched (total, ...) packed rows -> (N * total, ...)."""
        if t is None:
            return None
        t = t.expand(self.n, *t.shape) if dim is None else t.movedim(dim, 0)
        return t.reshape(-1, *t.shape[2:])

    def columns(self, t, dim):
        """(N, Hx, total) or unbatched (Hx, total) -> (Hx, N * total): per-token operands, lse."""
        if t is None:
            return None
        t = t.expand(self.n, *t.shape) if dim is None else t.movedim(dim, 0)
        return t.transpose(0, 1).reshape(t.shape[1], -1)

    def mask(self, mask, dim):
        folded = self.columns(mask, dim)
        return self.in_sequence if folded is None else folded & self.in_sequence

    def unrows(self, t):
        return t.unflatten(0, (self.n, -1))

    def uncolumns(self, t):
        return t.unflatten(1, (self.n, -1)).transpose(0, 1)


def _per_sample_rows(t, dim) -> int:
    return t.shape[0] if dim is None else t.movedim(dim, 0).shape[1]


def _fold_varlen(info, op, in_dims, args, kwargs, rows=(), columns=()):
    """(folded call, fold) of a varlen op's call: its N samples as one packed batch."""
    call, dims = _bound(op, in_dims, args, kwargs)
    f = _VarlenFold(info.batch_size, call, dims)
    folded = dict(
        call, cu_seqlens_q=f.cu_q, cu_seqlens_k=f.cu_k, max_seqlen_q=f.max_q,
        max_seqlen_k=f.max_k, mask=f.mask(call["mask"], dims["mask"]),
    )  # fmt: skip
    for name in ("query", "key", "value", *rows):
        folded[name] = f.rows(call[name], dims[name])
    for name in ("bias", *columns):
        folded[name] = f.columns(call[name], dims[name])
    return unbind(op, folded), f


@torch.library.register_vmap("dmattn::attention_varlen_forward")
def _varlen_forward_vmap(info, in_dims, *args, **kwargs):
    op = torch.ops.dmattn.attention_varlen_forward.default
    folded, f = _fold_varlen(info, op, in_dims, args, kwargs)
    out, lse, lse_rem = op(*folded)
    return (f.unrows(out), f.uncolumns(lse), f.uncolumns(lse_rem)), (0, 0, 0)


@torch.library.register_vmap("dmattn::attention_varlen")
def _varlen_vmap(info, in_dims, *args, **kwargs):
    op = torch.ops.dmattn.attention_varlen.default
    folded, f = _fold_varlen(info, op, in_dims, args, kwargs)
    return f.unrows(op(*folded)), 0


@torch.library.register_vmap("dmattn::attention_varlen_backward")
def _varlen_backward_vmap(info, in_dims, *args, **kwargs):
    op = torch.ops.dmattn.attention_varlen_backward.default
    rows, columns = ("grad_out", "out"), ("grad_lse", "lse", "lse_rem")
    folded, f = _fold_varlen(info, op, in_dims, args, kwargs, rows, columns)
    call = bind(op, folded)
    compute_dbias = call["compute_dbias"] and call["bias"] is not None
    dq, dk, dv, dbias = op(*unbind(op, dict(call, compute_dbias=compute_dbias)))
    grads = (f.unrows(dq), f.unrows(dk), f.unrows(dv))
    if not compute_dbias:
        return (*grads, dbias), (0, 0, 0, None)
    return (*grads, f.uncolumns(dbias)), (0, 0, 0, 0)  # each sample its own dbias
