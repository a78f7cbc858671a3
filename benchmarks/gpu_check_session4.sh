#!/usr/bin/env bash
# One device run: new ops on CUDA, export on CUDA (ExportedProgram + AOTInductor), and the latent
# cache against Hugging Face's default cache under transformers 5.17 (installed) and 5.14.1
# (carried wheel in .whl/). Logs under $OUT.
set -u
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/device.txt"
export PYTHONPATH=.
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/mla_ops/test_paged_ops.py tests/mla_ops/test_opcheck.py 2>&1 | tail -4 | tee "$OUT/tests.log"
timeout 150 python3 benchmarks/gpu_check_export.py "$OUT" 2>&1 | grep -v Warning | tail -12 | tee "$OUT/export.log"
timeout 170 python3 benchmarks/gpu_check_cache.py --layers 2 --out "$OUT/cache_latest.json" 2>&1 | grep -v Warning | tail -8 | tee "$OUT/cache_latest.log"
pip install -q --no-deps --target /tmp/tf514 .whl/transformers-5.14.1-py3-none-any.whl 2>&1 | tail -1
PYTHONPATH=/tmp/tf514:. timeout 170 python3 benchmarks/gpu_check_cache.py --layers 2 --out "$OUT/cache_514.json" 2>&1 | grep -v Warning | tail -8 | tee "$OUT/cache_514.log"
