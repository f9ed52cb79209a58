#!/usr/bin/env bash
# The staging A/B on this machine's accelerator, with real host-to-device copies (docs/bench.md,
# "On an accelerator"). Usage: tools/device_check.sh [OUT_DIR]   (default device-check/)
#
# 1. A Python whose JAX sees an accelerator: $PYTHON, else python3 when its JAX already does (a
#    prepared GPU image), else a venv (.venv-device) with jax[cuda12] from the package registry.
#    The plugin runs from this checkout (PYTHONPATH); the bench needs no other package.
# 2. tunix-stage bench --quick --h2d real --microbatches 9 (the default 16 MiB micro-batches), and
#    a 1 GiB run (4 micro-batches: inline, depth2_prestage, resident).
# 3. OUT_DIR/device-check.json: both runs' bench JSON, the devices, the exit codes.
# Exits non-zero when a run fails a correctness check (same parameters in every mode, the training
# order, the device bound) or cannot run; timing checks are reported, not failed. Under 5 minutes
# on one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-device-check}"
mkdir -p "$out"

accelerated() {  # $1: a python; true when its JAX's default backend is not the CPU
  "$1" -c 'import jax, sys; sys.exit(jax.default_backend() == "cpu")' >/dev/null 2>&1
}

python="${PYTHON:-}"
if [ -z "$python" ]; then
  if accelerated python3; then
    python=python3
  else
    echo "device_check: no JAX with an accelerator here; installing jax[cuda12] into .venv-device" >&2
    python3 -m venv .venv-device
    .venv-device/bin/pip install -q 'jax[cuda12]' numpy grpcio cloudpickle optax looptime
    python=.venv-device/bin/python
  fi
fi
if ! accelerated "$python"; then
  echo "device_check: error: $python's JAX sees no accelerator (jax.default_backend() is cpu); accepted: a machine with a GPU or TPU and a JAX built for it" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$python" -c 'import jax; print("device_check: devices", jax.devices())'

status=0
run() {  # $1: name; the rest: bench options
  local name="$1"
  shift
  local code=0
  "$python" -m tunix_stage_plugin bench --quick --h2d real --out "$out/$name" "$@" || code=$?
  echo "$name $code" >>"$out/codes"
  if [ "$code" -ne 0 ]; then status=1; fi
}
: >"$out/codes"
run m9 --microbatches 9
run gib --payload_mib 1024 --microbatches 4 --modes inline,depth2_prestage,resident

"$python" - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
codes = dict(line.split() for line in open(os.path.join(out, "codes")))
report = {"runs": {}, "exit_codes": {k: int(v) for k, v in codes.items()}}
for name in codes:
  path = os.path.join(out, name, "bench.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      report["runs"][name] = json.load(f)
with open(os.path.join(out, "device-check.json"), "w", encoding="utf-8") as f:
  json.dump(report, f, indent=1)
for name, run in report["runs"].items():
  modes = run["modes"]
  pre = modes.get("depth2_prestage", {})
  print(f"device_check: {name}: depth2_prestage hidden {pre.get('hidden_fraction')}, step/limit "
        f"{pre.get('step_over_limit')}, device memory {pre.get('device_memory')}")
print(f"device_check: wrote {os.path.join(out, 'device-check.json')}")
EOF
exit "$status"
