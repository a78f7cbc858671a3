#!/usr/bin/env bash
# GPU correctness for the attention mask and the fx_passes rewrite (run on the device machine).
set -u
export PYTHONPATH=$PWD
mkdir -p "${OUT:-/tmp/out}"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/mla_ops -k "mask or hidden or opcheck or deepseek_v3_shapes" 2>&1 | tail -15 | tee "${OUT:-/tmp/out}/gpu_mask_tests.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/fx_passes/test_absorb_graph.py 2>&1 | tail -5 | tee -a "${OUT:-/tmp/out}/gpu_mask_tests.log"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/fx_passes/test_hf_models.py -k "decode_step_float64 or inductor" 2>&1 | tail -5 | tee -a "${OUT:-/tmp/out}/gpu_mask_tests.log"
