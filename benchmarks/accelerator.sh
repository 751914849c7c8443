#!/usr/bin/env bash
# Denoising, decoding and reference-KV figures on one accelerator, from a random checkpoint
# with the real transformer and VAE geometry (docs/benchmarks.md quotes its results).
#
#   OUT=/tmp/acc benchmarks/accelerator.sh            # 9B geometry, 1024x1024
#   PRESET=tiny HW=256 OUT=/tmp/acc benchmarks/accelerator.sh   # a dry run on any host
#
# STEPS picks and orders the runs (default: kv4 generate generate_fast kv1; also kv2; flat:
# convert to the flat layout, then the generate run loading from it; h2d: host-to-device
# copy bandwidth, the limit of any load onto the accelerator). Each is a fresh
# process with its own time limit; a failed step is reported and the next one runs.
# Results: $OUT/<step>.json, everything printed on stderr in $OUT/log.txt. Run it from the
# repository root; where flux2klein cannot be installed (an offline accelerator host with
# its own jax), PYTHONPATH=$PWD is enough.
set -u
PRESET=${PRESET:-9b-bench}
HW=${HW:-1024}
REPS=${REPS:-3}
OUT=${OUT:-/tmp/flux2klein-accelerator}
CK=${CK:-/tmp/flux2klein-$PRESET}
STEP_LIMIT=${STEP_LIMIT:-300}
STEPS=${STEPS:-kv4 generate generate_fast kv1}
BS=${BS:-4}  # images per generate run
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 FLUX2KLEIN_COMPILE_CACHE=${FLUX2KLEIN_COMPILE_CACHE:-$OUT/executables}
mkdir -p "$OUT"


step() {  # step NAME COMMAND...: time one command, keep its stdout as NAME.json
  local name=$1; shift
  local start=$SECONDS
  echo "== $name" >>"$OUT/log.txt"
  timeout "$STEP_LIMIT" "$@" >"$OUT/$name.json" 2> >(tee -a "$OUT/log.txt" | tail -n 3 | cut -c1-300 >&2)
  echo "== $name: exit $? in $((SECONDS - start)) s"
}

"$PY" - <<'PY' 2>&1 | tee "$OUT/env.txt"
import jax, flax
print("jax", jax.__version__, "flax", flax.__version__, jax.devices())
PY
if [ ! -f "$CK/model_index.json" ]; then
  start=$SECONDS
  "$PY" -m flux2klein_cli.core.hub.random_checkpoint "$CK" --preset "$PRESET" --kv --workers "$(nproc)" || exit 1
  echo "== checkpoint $PRESET written in $((SECONDS - start)) s: $(du -sh "$CK" | cut -f1)"
fi
"$PY" - <<'PY' >"$OUT/attention.txt" 2>&1 || export FLUX2KLEIN_GPU_ATTENTION=xla
# The fused attention this backend uses against XLA's form, at the edit's unequal lengths.
import jax, jax.numpy as jnp
from flux2klein_cli.core.models.layers import dot_product_attention, gpu_fused_attention
keys = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(keys[0], (1, 1000, 8, 128), jnp.bfloat16)
k, v = (jax.random.normal(x, (1, 3001, 8, 128), jnp.bfloat16) for x in keys[1:])
ours = dot_product_attention(q, k, v).astype(jnp.float32)
ref = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                   implementation="xla")
error = float(jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref))
print("fused:", gpu_fused_attention(q), "relative error vs fp32 XLA:", error)
assert error < 2e-2, "attention off by more than bf16 rounding"
PY
tail -n 3 "$OUT/attention.txt"; echo "attention: ${FLUX2KLEIN_GPU_ATTENTION:-default}"
common=(--model "$CK" --height "$HW" --width "$HW" --reps "$REPS" --json)
for name in $STEPS; do
  case $name in
    kv4) step kv4 "$PY" -m flux2klein_cli bench "${common[@]}" --refs 4 --kv ;;
    kv2) step kv2 "$PY" -m flux2klein_cli bench "${common[@]}" --refs 2 --kv ;;
    kv1) step kv1 "$PY" -m flux2klein_cli bench "${common[@]}" --refs 1 --kv ;;
    generate) step generate "$PY" -m flux2klein_cli bench "${common[@]}" --bs "$BS" ;;
    generate_fast) step generate_fast "$PY" -m flux2klein_cli bench "${common[@]}" --bs "$BS" --effort fast ;;
    flat)
      [ -f "$CK-flat/model_index.json" ] || step convert "$PY" -m flux2klein_cli convert "$CK" --out "$CK-flat" --json
      step generate_flat "$PY" -m flux2klein_cli bench "${common[@]/#$CK/$CK-flat}" --bs "$BS" ;;
    h2d) "$PY" - <<'PY' 2>&1 | tee "$OUT/h2d.txt"
import time, numpy as np, jax
host = np.ones(4 << 30, np.uint8)  # 4 GiB, every page touched
for _ in range(4):
    start = time.perf_counter(); jax.device_put(host).block_until_ready(); seconds = time.perf_counter() - start
    print(f"h2d: 4 GiB in {seconds:.3f} s, {4 * 2**30 / seconds / 1e9:.1f} GB/s")
PY
      ;;
    *) echo "unknown step $name" ;;
  esac
done
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("kv4", "kv2", "kv1", "generate", "generate_fast", "generate_flat"):
    if not (out / f"{name}.json").exists():
        continue
    try:
        r = json.loads((out / f"{name}.json").read_text())
    except Exception as e:
        print(name, "no result:", type(e).__name__); continue
    phases = {p: round(v["median"], 3) for p, v in r["phases"].items()}
    line = f"{name}: load {r['load_components_s']} s,"
    line += f" compile {[(e['name'], e['status'], round(e.get('compile_s') or 0, 1)) for e in r['executables'] or []]},"
    line += f" load {r['load_s']:.1f} s, first call {r['first_call_s']:.1f} s, steady {phases}"
    if "kv" in r:
        kv = {p: round(v["median"], 3) for p, v in r["kv"]["phases"].items()}
        line += f"; kv {kv}; speed-up {r['kv_speedup']}; reuse {r['kv_reuse']}"
    print(line)
PY
