import torch, torch.nn.functional as F
from triton.testing import do_bench
from torch.nn.attention import SDPBackend
q = torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(4, 4, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(4, 4, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.bfloat16)
print("choice gqa", SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=True)))
def sdpa():
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(g)
def flash():
    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0].backward(g)
def flash_fwd():
    with torch.no_grad(): torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
def sdpa_fwd():
    with torch.no_grad(): F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
for n, f in (("sdpa fwd+bwd", sdpa), ("flash fwd+bwd", flash), ("sdpa fwd", sdpa_fwd), ("flash fwd", flash_fwd)):
    print(n, round(do_bench(f), 3), "ms")
