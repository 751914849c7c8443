# Sourced by round_cpu.sh and overheads_cpu.sh: their folder, interpreter, a private executable
# store, the medium checkpoint (built once), the CPU's name, and serve started on 127.0.0.1.
OUT=${OUT:-/tmp/flux2klein-round}
PY=${PYTHON:-python3}
REQUESTS=${REQUESTS:-16}
mkdir -p "$OUT"
export FLUX2KLEIN_COMPILE_CACHE=$OUT/executables FLUX2KLEIN_XLA_CACHE=off
M=$OUT/medium
[ -d "$M" ] || "$PY" -m flux2klein_cli.core.hub.random_checkpoint "$M" --preset medium >/dev/null
lscpu | grep -m1 'Model name' | sed 's/^/cpu: /'
port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

# `start_server ARGS...`: `flux2klein serve ARGS` on $port (its log in $OUT/serve.log), in $server,
# once /readyz answers; killed when the script exits.
start_server() {
  "$PY" -m flux2klein_cli serve --port "$port" "$@" 2>>"$OUT/serve.log" &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$port/readyz" >/dev/null; do sleep 2; kill -0 $server; done
}
