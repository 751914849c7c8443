#!/usr/bin/env bash
# Quantized transformer files (GGUF BF16, Q8_0, Q4_K; ComfyUI fp8) against bf16 on the medium geometry:
# load time, peak memory, bytes held, per-image time (docs/benchmarks.md, "Quantized transformer files").
#   bash benchmarks/quantized_files.sh [--rounds 5] [--size 256] [--steps 4]
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/cpu_common.sh
"$PY" benchmarks/quantized_files.py "$M" "$OUT/quantized" "$@"
