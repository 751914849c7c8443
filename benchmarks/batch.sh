#!/usr/bin/env bash
# `flux2klein batch` against one `generate` process per item (issue 31's Speed section):
# ITEMS items over four shapes, once as one batch run, once as a shell loop of generate
# processes, both on a warm executable store (a first batch run fills it and is not timed).
#
#   MODEL=4b HW=512 OUT=/tmp/bb benchmarks/batch.sh                # the issue's figures
#   MODEL=tiny HW=32 STEPS=1 ITEMS=8 OUT=/tmp/bb benchmarks/batch.sh   # a dry run on any host
#
# Prints one JSON line: items, the batch run's images/s and seconds, the loop's seconds and
# the ratio. Everything else goes to $OUT/log.txt. Run it from the repository root.
set -eu
MODEL=${MODEL:-4b}
HW=${HW:-512}
ITEMS=${ITEMS:-32}
BS=${BS:-4}
DTYPE=${DTYPE:-bf16}
STEPS=${STEPS:-}
OUT=${OUT:-/tmp/flux2klein-batch-bench}
PY=${PYTHON:-python3}
export FLUX2KLEIN_COMPILE_CACHE=${FLUX2KLEIN_COMPILE_CACHE:-$OUT/executables}
rm -rf "$OUT/warm" "$OUT/batch" "$OUT/loop"
mkdir -p "$OUT/loop"
: >"$OUT/log.txt"

# Four shapes: HW x HW, HW x (HW+64), (HW+64) x HW, (HW+64) x (HW+64), items round-robin.
"$PY" - "$ITEMS" "$HW" >"$OUT/jobs.jsonl" <<'EOF'
import json, sys
items, hw = int(sys.argv[1]), int(sys.argv[2])
sizes = [(hw, hw), (hw, hw + 64), (hw + 64, hw), (hw + 64, hw + 64)]
for i in range(items):
    h, w = sizes[i % 4]
    print(json.dumps({"prompt": f"a lighthouse at dawn, study {i}", "seed": i, "height": h, "width": w}))
EOF

common=(--model "$MODEL" --dtype "$DTYPE")
[ -n "$STEPS" ] && common+=(--steps "$STEPS")

"$PY" -m flux2klein_cli batch "$OUT/jobs.jsonl" --out-dir "$OUT/warm" --bs "$BS" "${common[@]}" --json \
  >/dev/null 2>>"$OUT/log.txt"
start=$(date +%s.%N)
"$PY" -m flux2klein_cli batch "$OUT/jobs.jsonl" --out-dir "$OUT/batch" --bs "$BS" "${common[@]}" --json \
  >"$OUT/batch.json" 2>>"$OUT/log.txt"
batch_s=$(echo "$(date +%s.%N) - $start" | bc)

# The loop: one generate per item, as a runbook's shell loop would, on a store already warm
# for its batch-1 shapes (one untimed generate per shape first), so both sides compile nothing.
for hw2 in "$HW $HW" "$HW $((HW + 64))" "$((HW + 64)) $HW" "$((HW + 64)) $((HW + 64))"; do
  set -- $hw2
  "$PY" -m flux2klein_cli generate "warm-up" --height "$1" --width "$2" "${common[@]}" -o "$OUT/loop/warm.png" \
    --force --json >/dev/null 2>>"$OUT/log.txt"
done
rm -f "$OUT/loop/warm.png"
start=$(date +%s.%N)
i=0
while IFS= read -r line; do
  prompt=$(echo "$line" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["prompt"])')
  h=$(echo "$line" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["height"])')
  w=$(echo "$line" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["width"])')
  "$PY" -m flux2klein_cli generate "$prompt" --seed "$i" --height "$h" --width "$w" "${common[@]}" \
    -o "$OUT/loop/$i.png" --json >/dev/null 2>>"$OUT/log.txt"
  i=$((i + 1))
done <"$OUT/jobs.jsonl"
loop_s=$(echo "$(date +%s.%N) - $start" | bc)

"$PY" - "$OUT/batch.json" "$batch_s" "$loop_s" "$ITEMS" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
batch_s, loop_s = float(sys.argv[2]), float(sys.argv[3])
print(json.dumps(dict(items=int(sys.argv[4]), batch_images_per_second=report["images_per_second"],
                      batch_seconds=round(batch_s, 2), loop_seconds=round(loop_s, 2),
                      loop_over_batch=round(loop_s / batch_s, 2), programs_loaded=report["programs_loaded"],
                      programs_compiled=report["programs_compiled"])))
EOF
