#!/usr/bin/env bash
# serve against bench (docs/benchmarks.md, "serve as OpenAI clients call it"): the medium checkpoint,
# SIZE x SIZE (default 512), DTYPE (default bf16), a warm executable store, every server on 127.0.0.1 with --max-batch 8.
#   1. bench at batch 1 and 8 (the references), before and after the rounds;
#   2. ROUNDS rounds, each starting one server with --encode-threads 0 (the worker encodes) and one
#      with the default (encoding beside the device thread), in turns: concurrency 1 ($REQUESTS
#      requests) and concurrency 8 (2 x $REQUESTS), then streamed requests with 1 and 3 partial
#      images at concurrency 1 (the first partial image's latency).
#   OUT=/tmp/round ROUNDS=3 benchmarks/serve_cpu.sh     (about 25 minutes on 2 cores, the store warm)
set -eu
. "$(dirname "$0")/cpu_common.sh"
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-512}
DTYPE=${DTYPE:-bf16}  # fp32 on a CPU without bf16 arithmetic (no AVX512-BF16 or AMX)
bench() {
  "$PY" -m flux2klein_cli bench --model "$M" --height "$SIZE" --width "$SIZE" --bs "$1" --reps "$2" --dtype "$DTYPE" --json \
    2>>"$OUT/log.txt" | "$PY" -c "import json,sys; r=json.load(sys.stdin); print(json.dumps({'bench_bs': $1,
    'per_image_s': round(r['per_image_s'], 3)}))"
}
bench 1 5
bench 8 3
load() { "$PY" benchmarks/serve_load.py --url "http://127.0.0.1:$port" --size "${SIZE}x$SIZE" --json --no-warmup "$@"; }
for round in $(seq "$ROUNDS"); do
  for threads in 0 default; do
    flag=(); [ "$threads" = default ] || flag=(--encode-threads "$threads")
    start_server --model "$M" --dtype "$DTYPE" --max-batch 8 --warm "${SIZE}x$SIZE" "${flag[@]}"
    load --requests 2 --concurrency 1 >/dev/null  # the first requests after warming
    echo "{\"round\": $round, \"encode_threads\": \"$threads\"}"
    load --requests "$REQUESTS" --concurrency 1
    load --requests $((2 * REQUESTS)) --concurrency 8
    if [ "$threads" = default ]; then
      load --requests 2 --concurrency 1 --partial-images 1 >/dev/null  # compiles the chunked loops
      load --requests 2 --concurrency 1 --partial-images 3 >/dev/null
      load --requests 8 --concurrency 1 --partial-images 1
      load --requests 8 --concurrency 1 --partial-images 3
    fi
    kill -TERM $server; wait $server || true
  done
done
bench 1 5
bench 8 3
