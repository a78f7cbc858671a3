"""GPU check of backend="mla": plain torch.compile and Hugging Face's compile_config (CUDA graphs).

Run on the device machine: PYTHONPATH=.:<entry-point dir> python3 benchmarks/gpu_check_backend.py
"""

import torch
import transformers
from torch._dynamo.utils import counters

from tests.fx_passes.tiny_models import left_padded_batch, tiny_model

for dtype in (torch.float32, torch.bfloat16):
    model = tiny_model("deepseek_v3", dtype=dtype).cuda()
    ids, mask = (t.cuda() for t in left_padded_batch((5, 11), seed=2))
    args = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **args)
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        counters.clear()
        config = transformers.CompileConfig(backend="mla", fullgraph=True, mode=mode)
        got = model.generate(ids, **args, cache_implementation="static", compile_config=config)
        same = (got == want).float().mean().item()
        print(
            f"{dtype} compile_config mode={mode}: sites={counters['mla']['absorbed_sites']} "
            f"tokens equal to eager: {same:.3f}"
        )
    torch._dynamo.reset()
    counters.clear()
    compiled = tiny_model("deepseek_v3", dtype=dtype).cuda()
    compiled.load_state_dict(model.state_dict())
    compiled.forward = torch.compile(compiled.forward, backend="mla", fullgraph=True)
    got = compiled.generate(ids, **args)
    same = (got == want).float().mean().item()
    print(
        f"{dtype} torch.compile(backend='mla') DynamicCache: "
        f"sites={counters['mla']['absorbed_sites']} tokens equal to eager: {same:.3f}"
    )
