#!/usr/bin/env bash
# This round's CPU figures in one run (docs/benchmarks.md, "Engine, batch and serve"): on the
# medium checkpoint at 512x512 (and 576 for batch's four shapes), bf16:
#   1. bench's steady state per image at batch 1, 4 and 8 (the references for 2 and 3);
#   2. benchmarks/batch.sh: 32 items of 4 shapes as one batch run against one generate each;
#   3. serve at concurrency 1, 4 and 8 (benchmarks/serve_load.py, 127.0.0.1 only);
#   4. a KV edit through serve whose reference is reused against one that computes it.
#   OUT=/tmp/round benchmarks/round_cpu.sh     (about 15 minutes on 2 cores)
set -eu
. "$(dirname "$0")/cpu_common.sh"
MKV=$OUT/medium-kv
[ -d "$MKV" ] || "$PY" -m flux2klein_cli.core.hub.random_checkpoint "$MKV" --preset medium --kv >/dev/null

for bs in 1 4 8; do
  "$PY" -m flux2klein_cli bench --model "$M" --height 512 --width 512 --bs "$bs" --reps 3 --dtype bf16 --json \
    2>>"$OUT/log.txt" | "$PY" -c "import json,sys; r=json.load(sys.stdin); print(json.dumps({'bench_bs': $bs,
    'per_image_s': round(r['per_image_s'], 3), 'run_s': round(r['run_s']['median'], 3)}))"
done
for hw in "512 576" "576 512" "576 576"; do
  set -- $hw
  "$PY" -m flux2klein_cli bench --model "$M" --height "$1" --width "$2" --bs 4 --reps 3 --dtype bf16 --json \
    2>>"$OUT/log.txt" | "$PY" -c "import json,sys; r=json.load(sys.stdin); print(json.dumps({'bench_bs': 4,
    'size': '$2x$1', 'per_image_s': round(r['per_image_s'], 3)}))"
done

MODEL=$M HW=512 ITEMS=32 BS=4 OUT=$OUT/batch bash benchmarks/batch.sh

start_server --model "$M" --max-batch 8 --warm 512x512 --queue 64
"$PY" benchmarks/serve_load.py --url "http://127.0.0.1:$port" --size 512x512 --requests "$REQUESTS" --json
kill -TERM $server; wait $server || true

start_server --model "$MKV" --max-batch 1 --warm 512x512
"$PY" - "$port" "$M" <<'PYEOF'
import io, json, sys, time
import httpx
from PIL import Image
port = sys.argv[1]
def ref(color):
    out = io.BytesIO(); Image.new("RGB", (512, 512), color).save(out, format="PNG"); return out.getvalue()
def edit(image, seed):
    start = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/images/edits", timeout=600,
                   data={"prompt": "make it night", "size": "512x512", "kv": "true", "seed": str(seed)},
                   files={"image": ("ref.png", image, "image/png")})
    r.raise_for_status()
    return time.perf_counter() - start
edit(ref((10, 20, 30)), 0)  # compiles the KV programs at this shape
computed = [edit(ref((40 + i, 90, 200)), i) for i in range(3)]  # a new reference each: computed
reused = [edit(ref((40, 90, 200)), 10 + i) for i in range(3)]  # the first of those again: reused
print(json.dumps({"kv_edit_computed_s": sorted(computed)[1], "kv_edit_reused_s": sorted(reused)[1]}))
PYEOF
kill -TERM $server; wait $server || true
