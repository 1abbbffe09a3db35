import os, torch, dmattn_ops
os.environ["DMATTN_DENSE_SDPA"] = "0"; os.environ["DMATTN_INDUCTOR_KERNELS"] = "1"
q, k, v = (torch.randn(2, 300, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
f = torch.compile(lambda q, k, v: dmattn_ops.attention(q, k, v, is_causal=True), fullgraph=True)
try:
    f(q, k, v); print("D64 compiled OK")
except Exception as e:
    print("D64 failed:", type(e).__name__, str(e).splitlines()[0][:200])
