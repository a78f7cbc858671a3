#!/usr/bin/env bash
# Second device run: the export check's error, and the transformers 5.14.1 cache comparison
# (its tokenizers pin needs the carried tokenizers 0.22.2 wheel).
set -u
mkdir -p "$OUT"
export PYTHONPATH=.
timeout 150 python3 benchmarks/gpu_check_export.py "$OUT" > "$OUT/export_full.log" 2>&1
grep -E "Error|error|export |relative|AOTI|package" "$OUT/export_full.log" | grep -v "^  File" | head -20
pip install -q --no-deps --target /tmp/tf514 .whl/transformers-5.14.1-py3-none-any.whl .whl/tokenizers-0.22.2-*.whl 2>&1 | grep -v WARNING | tail -1
PYTHONPATH=/tmp/tf514:. timeout 200 python3 benchmarks/gpu_check_cache.py --layers 2 --out "$OUT/cache_514.json" > "$OUT/cache_514_full.log" 2>&1
grep -v "Warning\|warn" "$OUT/cache_514_full.log" | tail -8
