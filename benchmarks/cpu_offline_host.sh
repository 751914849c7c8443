#!/usr/bin/env bash
# flux2klein against diffusers on the CPU of a second, offline machine (this workplace's device
# machine: no package registry, a wheel index of its own), from a checkout of the repository:
# installs the dependencies into $SITE from local wheels (its index, plus wheels carried in
# .whl-tpu/, as the device tool's notes describe), says what the CPU is (the flags /proc/cpuinfo shows, what
# the compiler's cpuid sees, which kernels torch and flux2klein pick), then runs
# benchmarks/cpu_vs_diffusers.py --xla-too (ours with its kernel plugin, ours in XLA's forms, and
# diffusers, interleaved). Results: $OUT/host.txt, $OUT/vs.txt (its table) and $OUT/runs.txt (each run).
#
# libtpu, where installed, is hidden from every run (a module of that name that fails to import comes
# first on the path): jax imports it and starts the TPU runtime even under JAX_PLATFORMS=cpu, which a CPU
# machine's user never has, and torch's runs have no counterpart of it.
#
#   OUT=/tmp/host benchmarks/cpu_offline_host.sh 3        # 3 rounds
#   DTYPES=fp32 benchmarks/cpu_offline_host.sh 3           # fp32 only (diffusers' bf16 crawls without AVX-512 bf16)
#   . benchmarks/cpu_offline_host.sh 0                     # install and describe only, in this shell
set -u
ROUNDS=${1:-3}
OUT=${OUT:-/tmp/flux2klein-host}
SITE=${SITE:-/tmp/flux2klein-site}
WORK=${WORK:-/tmp/flux2klein-host-work}  # the checkpoint and the executable store, kept between calls
mkdir -p "$OUT" "$WORK"
mkdir -p "$WORK/no-libtpu/libtpu"
echo 'raise ImportError("libtpu is hidden from this CPU benchmark")' > "$WORK/no-libtpu/libtpu/__init__.py"
export PYTHONPATH=$WORK/no-libtpu:$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH} JAX_PLATFORMS=cpu FLUX2KLEIN_CACHE=$WORK/cache \
  PYTHONUNBUFFERED=1 PIP_CONFIG_FILE=/dev/null
if ! python3 -c 'import flax, diffusers, torch, typer, skimage' 2>/dev/null; then
  start=$SECONDS
  python3 -m pip install --isolated -q --only-binary=:all: --no-cache-dir --target "$SITE" \
    --index-url "${INDEX:-file:///opt/pypi/simple}" --find-links "${TORCH_WHEELS:-/opt/wheels}" \
    --find-links "$PWD/.whl-tpu" \
    jax==0.10.2 jaxlib==0.10.2 flax orbax-checkpoint tensorstore "etils[epath]" "ml_dtypes<0.7" numpy safetensors \
    huggingface_hub transformers tokenizers jinja2 typer rich tqdm pillow scikit-image gguf torch==2.13.0 \
    diffusers==0.42.1 || exit 1
  echo "installed in $((SECONDS - start)) s"
fi
{
  grep -m1 'model name' /proc/cpuinfo; echo "cpus: $(nproc)"
  echo "cpuinfo flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512_bf16|amx_tile)$' | tr '\n' ' ')"
  echo "compiler's cpuid: $(gcc -march=native -Q --help=target 2>/dev/null | grep -E -- '-m(avx2|avx512f|avx512bf16|amx-tile) ' | tr -s ' \t' ' ' | tr '\n' ';')"
  python3 - <<'PY'
import jax, torch
from flux2klein_cli.core.models import kernels
print("jax", jax.__version__, "torch", torch.__version__, "torch kernels:", torch.backends.cpu.get_cpu_capability())
print("flux2klein:", kernels.report())
PY
} 2>&1 | tee "$OUT/host.txt"
[ "$ROUNDS" -gt 0 ] || return 0 2>/dev/null || exit 0
python3 benchmarks/cpu_vs_diffusers.py --rounds "$ROUNDS" --dtypes "${DTYPES:-fp32,bf16}" --xla-too --out "$WORK/vs" 2> >(tee "$OUT/runs.txt" >&2) | tee "$OUT/vs.txt"
