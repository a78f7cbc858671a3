import torch

from mla_compile import export
from mla_compile.export import decode_inputs
from mla_compile.export.steps import DecodeStep
from tests.fx_passes.tiny_models import tiny_model

model = tiny_model("deepseek_v3", dtype=torch.float32).cuda()
args = decode_inputs(model, 4, 40, seed=1)
with torch.no_grad():
    want = DecodeStep(model)(*args)[0]
run = export.aoti.load_package("scratch/v3_f32.pt2")
with torch.no_grad():
    got = run(*args)[0]
print("fresh process: rel err", float((got - want).abs().max() / want.abs().max()))
import time

for fn, name in ((DecodeStep(model), "eager python"), (run, "package")):
    with torch.no_grad():
        for _ in range(3):
            fn(*args)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            fn(*args)
        torch.cuda.synchronize()
    print(name, f"{(time.perf_counter() - t) / 50 * 1e6:.0f} us/step")
