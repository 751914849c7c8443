#!/usr/bin/env bash
# What batch and serve add to bench's steady state, in one run (docs/benchmarks.md, "Engine,
# batch and serve"): the medium checkpoint, 512x512, bf16, a warm executable store.
#   1. bench at batch 1 and 4 (the references);
#   2. `flux2klein batch`: 16 items of one shape at --bs 4, after a 4-item run that fills the store;
#   3. serve at concurrency 1 (16 requests, the default batching window, --max-batch 8).
#   OUT=/tmp/round benchmarks/overheads_cpu.sh     (about 10 minutes on 2 cores, the store warm)
set -eu
. "$(dirname "$0")/cpu_common.sh"
for bs in 1 4; do
  "$PY" -m flux2klein_cli bench --model "$M" --height 512 --width 512 --bs "$bs" --reps 5 --dtype bf16 --json \
    2>>"$OUT/log.txt" | "$PY" -c "import json,sys; r=json.load(sys.stdin); print(json.dumps({'bench_bs': $bs,
    'per_image_s': round(r['per_image_s'], 3)}))"
done

"$PY" -c "import json
for i in range(16): print(json.dumps({'prompt': f'a lighthouse at dawn, study {i}', 'seed': i}))" >"$OUT/one-shape.jsonl"
head -4 "$OUT/one-shape.jsonl" >"$OUT/one-shape-warm.jsonl"
rm -rf "$OUT/b-warm" "$OUT/b16"
common=(--model "$M" --dtype bf16 --height 512 --width 512 --bs 4 --json)
"$PY" -m flux2klein_cli batch "$OUT/one-shape-warm.jsonl" --out-dir "$OUT/b-warm" "${common[@]}" >/dev/null 2>>"$OUT/log.txt"
"$PY" -m flux2klein_cli batch "$OUT/one-shape.jsonl" --out-dir "$OUT/b16" "${common[@]}" 2>>"$OUT/log.txt" |
  "$PY" -c "import json,sys; r=json.load(sys.stdin); print(json.dumps({'batch_items': r['items'],
  'run_s': round(r['seconds']['run'], 3), 'per_image_s': round(r['seconds']['run'] / r['images'], 3)}))"

start_server --model "$M" --max-batch 8 --warm 512x512
"$PY" benchmarks/serve_load.py --url "http://127.0.0.1:$port" --size 512x512 --requests "$REQUESTS" \
  --concurrency 1 --json
kill -TERM $server; wait $server || true
