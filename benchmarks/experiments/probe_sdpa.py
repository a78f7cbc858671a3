"""Which SDPA backend runs the original's call (bool mask, qk 192, v 128) and at what speed."""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, S, T = 1, 16, 8192, 8192
q = torch.randn(B, H, S, 192, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, H, T, 192, device="cuda", dtype=torch.bfloat16)
v = torch.randn(B, H, T, 128, device="cuda", dtype=torch.bfloat16)
mask = torch.ones(B, 1, S, T, dtype=torch.bool, device="cuda").tril()
for name, backends in [
    ("default", None),
    ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
    ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
    ("flash", [SDPBackend.FLASH_ATTENTION]),
]:
    try:
        ctx = (
            sdpa_kernel(backends)
            if backends
            else torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)
        )
        with ctx:
            for _ in range(2):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(5):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            e.record()
            torch.cuda.synchronize()
        print(f"sdpa backend {name}: {s.elapsed_time(e) / 5:.3f} ms")
    except Exception as error:
        print(f"sdpa backend {name}: {type(error).__name__}: {str(error)[:200]}")
