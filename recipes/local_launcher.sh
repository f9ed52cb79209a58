#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Runs the processes of one job on this machine, with the same staging environment as the
# Kubernetes containers (see k8s_launcher.sh): each process gets its role's staging variables
# and not the other role's. The processes talk over this machine's loopback and each logs to its
# own file; all of them are stopped when the job ends, fails or is interrupted, and on failure the
# tail of each log is printed. Linux only (it reads /proc).
#
# Hosts:
#   embedded  the plugin's embedded host: a trainer (tunix_stage_plugin.lab.embedded.trainer_main)
#             and an orchestrator (tunix_stage_plugin.lab.embedded.orchestrator_main) that runs
#             the job against it; the job is done when the orchestrator exits.
#   tunix     tunix's distributed runtime (python -m tunix.experimental.distributed.runtime.main)
#             running the plugin's small tunix job (tunix_stage_plugin.lab.tunix.job: tunix's
#             TrainerWorker and PeftTrainer with a small model on CPU, and an orchestrator running
#             tunix's train loop), or, when ORCHESTRATOR_MAIN, TRAINER_MAIN or ROLLOUT_MAIN is set,
#             mlperf_base.sh's three mains with the containers' arguments. Needs tunix installed
#             for $PYTHON with its runtime's protobuf modules generated (checked before anything
#             starts). tunix's own servers bind every interface, as tunix's code does.
#   auto      tunix when its runtime imports, embedded otherwise (the default).
set -euo pipefail

RECIPES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=cli_lib.sh
source "${RECIPES_DIR}/cli_lib.sh"
PROG="local_launcher.sh"
LOCALHOST="127.0.0.1"
TUNIX_RUNTIME_MODULE="tunix.experimental.distributed.runtime.main"
TUNIX_DISCOVERY_PROTO="tunix/experimental/distributed/runtime/discovery/discovery_service.proto"
TUNIX_JOB="tunix_stage_plugin.lab.tunix.job"
EMBEDDED_TRAINER="tunix_stage_plugin.lab.embedded.trainer_main"
EMBEDDED_ORCHESTRATOR="tunix_stage_plugin.lab.embedded.orchestrator_main"

usage() {
  cat <<EOF
usage: ${PROG} [--host auto|embedded|tunix] [--port PORT] [--steps N] [--microbatches M]
                       [--tiny] [--log_dir DIR] [--timeout SECS] [--startup_timeout SECS]
                       [-h|--help] [-- ORCHESTRATOR_ARGS...]

Starts one job's processes on this machine (talking over 127.0.0.1), waits for the job, then stops
every process it started. Exits with the job's status (2 for a usage or configuration error).

options:
  --host HOST             embedded, tunix or auto (default: auto = tunix when
                          ${TUNIX_RUNTIME_MODULE} imports, else embedded)
  --port PORT             the trainer's port (default: a free port, chosen by the trainer)
  --steps N               training steps (the containers' mains: their --max_steps)
  --microbatches M        micro-batches per step (embedded host, tunix's small job)
  --tiny                  a tiny model (embedded host, tunix's small job)
  --log_dir DIR           where the per-process logs go (default: a new temporary directory)
  --timeout SECS          stop everything and fail when the job (start-up included) has not
                          finished after SECS (default: 0, no limit)
  --startup_timeout SECS  how long the trainer may take to become ready (tunix's small job:
                          to register with the orchestrator) (default: 120)
  -h, --help              show this help and exit
  -- ARGS...              more flags for the orchestrator (embedded host), e.g.
                          -- --payload_mib 4 --wire_mbps 200

--host tunix runs, with tunix's runtime, the plugin's small tunix job
(${TUNIX_JOB}): an orchestrator running tunix's train loop and a trainer
node serving tunix's TrainerWorker and PeftTrainer, on CPU (no rollout model). With
ORCHESTRATOR_MAIN, TRAINER_MAIN or ROLLOUT_MAIN set it runs mlperf_base.sh's orchestrator,
trainer and rollout mains instead, with the containers' arguments. tunix's runtime needs its
discovery service's protobuf modules generated in tunix's checkout, as tunix documents (the
launcher checks before starting anything, and prints the command).

staging (validated by 'tunix-stage config --check'; a bad value stops the launcher):
  TUNIX_STAGE_BATCH               off | stage (default off)            orchestrator, trainer
  TUNIX_MAX_STAGED_BATCHES        stage-ahead depth, 1..1024 or auto (default auto, from 2) orchestrator
  TUNIX_STAGE_MAX_DEVICE_BATCHES  device-memory bound, 1..1024 (default 1) trainer
  TUNIX_STAGE_MAX_HOST_BATCHES    received-batch host bound, 1..1024 or auto (default auto, from 1) trainer
  TUNIX_STAGE_CODEC               stage payload codec, off | on | NAME[:LEVEL] (default off) orchestrator
  TUNIX_STAGE_ACCEPT_TRAIN_STAGE  a changed tunix train loop's fingerprint (default none) both
  TUNIX_STAGE_METRICS             a folder for each process's metrics record (default none) both
  TUNIX_STAGE_LOG_EVERY           the per-step line every N steps, 0 none (default 1) both
  TUNIX_STAGE_MEMORY_BUDGET       the bytes staged micro-batches may hold at auto, e.g. 6GiB
                                  (default a quarter of the machine's memory) both
The python that runs everything is \$PYTHON (default: the first of this checkout's
.venv/bin/python, the python next to 'tunix-stage' on PATH, python3, that has the plugin).
Numbers are decimal ASCII digits ("08" is 8); no value may hold a control character.
SIGINT/SIGTERM: prints "interrupted", stops every process it started (SIGTERM to each process
group, SIGKILL after STOP_GRACE seconds, default 10) and exits 130/143.
example:
  TUNIX_STAGE_BATCH=stage ${PROG} --host embedded --steps 2 --tiny
EOF
}

say() {
  echo "${PROG}: $*"
}

HOST="auto"
PORT=""
STEPS=""
MICROBATCHES=""
TINY=0
LOG_DIR=""
TIMEOUT=0
STARTUP_TIMEOUT=120
STOP_GRACE="${STOP_GRACE:-10}"
EXTRA_ORCH_ARGS=()
# --host tunix: the containers' mains when one is named here (before mlperf_base.sh's defaults).
CONTAINER_MAINS=0
[[ -z "${ORCHESTRATOR_MAIN:-}${TRAINER_MAIN:-}${ROLLOUT_MAIN:-}" ]] || CONTAINER_MAINS=1

while (($# > 0)); do
  set -- "$(canonical_flag "$1")" "${@:2}"
  case "$1" in
    --host=*) HOST="${1#*=}"; shift ;;
    --host) HOST="$(option_value "$1" "$#" "${2-}")"; shift 2 ;;
    --port=*) PORT="${1#*=}"; shift ;;
    --port) PORT="$(option_value "$1" "$#" "${2-}")"; shift 2 ;;
    --steps=*) STEPS="${1#*=}"; shift ;;
    --steps) STEPS="$(option_value "$1" "$#" "${2-}")"; shift 2 ;;
    --microbatches=*) MICROBATCHES="${1#*=}"; shift ;;
    --microbatches) MICROBATCHES="$(option_value "$1" "$#" "${2-}")"; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --log_dir=*) LOG_DIR="${1#*=}"; shift ;;
    --log_dir) LOG_DIR="$(option_value "$1" "$#" "${2-}")"; shift 2 ;;
    --timeout=*) TIMEOUT="${1#*=}"; shift ;;
    --timeout) TIMEOUT="$(option_value "$1" "$#" "${2-}")"; shift 2 ;;
    --startup_timeout=*) STARTUP_TIMEOUT="${1#*=}"; shift ;;
    --startup_timeout) STARTUP_TIMEOUT="$(option_value "$1" "$#" "${2-}")"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA_ORCH_ARGS=("$@"); break ;;
    *) usage_error "unknown option '$1'" ;;
  esac
done

# Every input is checked here, before anything starts: one error, exit 2.
case "${HOST}" in
  auto | embedded | tunix) ;;
  *) usage_error "--host must be auto, embedded or tunix, not $(printf '%q' "${HOST}")" ;;
esac
[[ -z "${PORT}" ]] || uint_option --port PORT 1 65535
[[ -z "${STEPS}" ]] || uint_option --steps STEPS 1 999999999
[[ -z "${MICROBATCHES}" ]] || uint_option --microbatches MICROBATCHES 1 999999999
uint_option --timeout TIMEOUT 0 999999999
uint_option --startup_timeout STARTUP_TIMEOUT 1 999999999
uint_option STOP_GRACE STOP_GRACE 0 3600
check_no_control --log_dir "${LOG_DIR}"
for arg in ${EXTRA_ORCH_ARGS[@]+"${EXTRA_ORCH_ARGS[@]}"}; do
  check_no_control "orchestrator argument" "${arg}"
done
# --timeout counts from here: starting the processes is part of the job.
JOB_DEADLINE=$((SECONDS + TIMEOUT))

# Defaults, and the staging values validated by the plugin (stops with its message when bad).
# shellcheck source=mlperf_base.sh
source "${RECIPES_DIR}/mlperf_base.sh"

# --- which host ---------------------------------------------------------------------------------

# Prints the first of the modules $@ that ${PYTHON} cannot find (nothing when it finds all).
python_missing() {
  "${PYTHON}" -c 'import importlib.util, sys
for name in sys.argv[1:]:
  try:
    found = importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    found = False
  if not found:
    print(name)
    break' "$@" 2>/dev/null
}

# What ${PYTHON}'s tunix runtime can do, in one interpreter (each import of tunix costs seconds):
# sets RUNTIME_STATE to "absent" (its main does not import), "ok", or, when $1 is "executor" and
# its process executor does not import, "protos" (the discovery service's protobuf modules are not
# generated: a tunix checkout does not carry them, tunix/experimental/distributed/examples/
# README.md) or "broken"; RUNTIME_TREE to tunix's checkout, RUNTIME_WHY to the import's error and
# HAS_PROTOC to "yes" where grpc_tools is installed.
probe_tunix_runtime() {
  local out lines
  out="$("${PYTHON}" -c 'import importlib, importlib.util, os, sys
try:
  importlib.import_module(sys.argv[1])
except ImportError:
  print("absent")
  sys.exit()
try:
  if sys.argv[2] == "executor":
    importlib.import_module("tunix.experimental.distributed.runtime.executor")
  print("ok")
except ImportError as e:
  import tunix
  print("protos" if "_pb2" in str(e) else "broken")
  print(os.path.dirname(os.path.dirname(os.path.abspath(tunix.__file__))))
  print(f"{type(e).__name__}: {e}".replace("\n", " "))
  print("yes" if importlib.util.find_spec("grpc_tools") else "no")' \
    "${TUNIX_RUNTIME_MODULE}" "$1" 2>/dev/null || echo absent)"
  mapfile -t lines <<<"${out}"
  RUNTIME_STATE="${lines[0]:-absent}" RUNTIME_TREE="${lines[1]:-}" RUNTIME_WHY="${lines[2]:-}"
  HAS_PROTOC="${lines[3]:-no}"
}

tunix_check="none" # tunix's process executor is imported by tunix's runtime main only
[[ "${RUNTIME_MAIN}" != "${TUNIX_RUNTIME_MODULE}" ]] || tunix_check="executor"
RUNTIME_STATE="absent"
[[ "${HOST}" == embedded ]] || probe_tunix_runtime "${tunix_check}"
if [[ "${HOST}" == auto ]]; then
  if [[ "${RUNTIME_STATE}" != absent ]]; then
    HOST=tunix
  else
    HOST=embedded
  fi
fi
if [[ "${HOST}" == tunix ]]; then
  if [[ "${RUNTIME_STATE}" == absent ]]; then
    die "tunix's distributed runtime is not installed for ${PYTHON}" \
      "('import ${TUNIX_RUNTIME_MODULE}' failed); install tunix, or use --host embedded"
  fi
  if ((${#EXTRA_ORCH_ARGS[@]})); then
    usage_error "'-- ARGS' are for the embedded host only"
  fi
  if ((CONTAINER_MAINS)) && { [[ -n "${MICROBATCHES}" ]] || ((TINY)); }; then
    usage_error "--microbatches and --tiny are for the embedded host and tunix's small job, not" \
      "the mains ORCHESTRATOR_MAIN, TRAINER_MAIN and ROLLOUT_MAIN name"
  fi
  if [[ "${RUNTIME_STATE}" == protos ]]; then
    tools=""
    [[ "${HAS_PROTOC}" == yes ]] || tools="${PYTHON} -m pip install grpcio-tools, then "
    die "tunix's runtime cannot start a process: its discovery service's protobuf modules are" \
      "not generated in ${RUNTIME_TREE}; generate them as tunix documents" \
      "(tunix/experimental/distributed/examples/README.md): ${tools}cd ${RUNTIME_TREE} &&" \
      "${PYTHON} -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=." \
      "${TUNIX_DISCOVERY_PROTO}"
  elif [[ "${RUNTIME_STATE}" == broken ]]; then
    die "tunix's runtime cannot start a process: 'import" \
      "tunix.experimental.distributed.runtime.executor' failed (${RUNTIME_WHY})"
  fi
  if ((CONTAINER_MAINS)); then
    for main in ORCHESTRATOR_MAIN TRAINER_MAIN ROLLOUT_MAIN; do
      module="${!main}"
      missing="$(python_missing "${module%.*}")"
      [[ -z "${missing}" ]] || die "${main}=${!main}: module ${missing} is not importable for" \
        "${PYTHON}"
    done
  elif [[ -n "$(python_missing "${TUNIX_JOB}")" ]]; then
    die "tunix's small job (${TUNIX_JOB}) is not in the tunix-stage-plugin that ${PYTHON}" \
      "imports"
  fi
else
  if ! "${PYTHON}" -c 'import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))' \
    "${EMBEDDED_TRAINER}" "${EMBEDDED_ORCHESTRATOR}" >/dev/null 2>&1; then
    die "the embedded host (${EMBEDDED_TRAINER}, ${EMBEDDED_ORCHESTRATOR}) is not in the" \
      "tunix-stage-plugin that ${PYTHON} imports"
  fi
fi

# --- processes ----------------------------------------------------------------------------------

if [[ -z "${LOG_DIR}" ]]; then
  LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/tunix-stage-local.XXXXXX")"
else
  mkdir -p "${LOG_DIR}"
fi

NAMES=()
PIDS=()
LOGS=()
declare -A REAPED=() # pid -> exit status, for the processes already waited for

# True while the process runs (a dead child not yet reaped is a zombie: not running).
proc_running() {
  local stat
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
  stat="${stat##*) }"
  [[ "${stat%% *}" != [ZX] ]]
}

# A free TCP port on 127.0.0.1, for tunix's runtime (another process could take it before it is
# used; a process that cannot bind then fails, and the launcher says so).
free_port() {
  "${PYTHON}" -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

# The environment a role's process runs with: everything here, less the staging variables that
# its container would not receive. Prints the `env -u ...` prefix, one word per line.
role_env_prefix() {
  local role="$1" keep name
  keep=" $(mlperf_stage_env_names "${role}") "
  printf '%s\n' env
  for name in ${MLPERF_ENV_ORCHESTRATOR} ${MLPERF_ENV_TRAINER}; do
    if [[ "${keep}" != *" ${name} "* ]]; then
      printf '%s\n' -u "${name}"
    fi
  done
}

# Whether setsid runs each process in its own process group (and session): then stopping a
# process stops its children too, and a Ctrl-C at the terminal reaches only the launcher, which
# stops everything once, in order. setpriv --pdeathsig makes the kernel send each process SIGTERM
# when the launcher dies, however it died (SIGKILL included), so nothing outlives it; then the
# child checks that the launcher is still its parent (one that died between the fork and the
# signal's setting would never send it) before it execs the command.
SETSID=()
if command -v setsid >/dev/null 2>&1; then
  SETSID=(setsid)
fi
PDEATHSIG=()
if command -v setpriv >/dev/null 2>&1 && setpriv --pdeathsig TERM true 2>/dev/null; then
  PDEATHSIG=(setpriv --pdeathsig TERM bash -c "[[ \"\${PPID}\" == \"\$0\" ]] || exit 143; exec \"\$@\"" "$$")
fi

# Starts a role's process in the background with its log, and records it.
#   $1 name (and log file name), $2 role (whose staging env it gets), then the command.
start_process() {
  local name="$1" role="$2" prefix=() staged="" var
  shift 2
  mapfile -t prefix < <(role_env_prefix "${role}")
  for var in $(mlperf_stage_env_names "${role}"); do
    staged+=" $(mlperf_shell_word "${var}=${!var}")" # one shell word per variable
  done
  local log="${LOG_DIR}/${name}.log"
  defer_signals # a signal here would otherwise exit before the new PID is recorded
  # setsid execs the command in place (a background child is never a group leader), so $! is the
  # command's PID and its process group ID.
  ${SETSID[@]+"${SETSID[@]}"} ${PDEATHSIG[@]+"${PDEATHSIG[@]}"} "${prefix[@]}" "$@" \
    >"${log}" 2>&1 {LAUNCHER_STDERR}>&- &
  local pid=$! waited=0
  # Until setsid has run, the child is a fork of this shell (with its traps) in this shell's
  # group, where a stop signal could be lost: wait (bounded) until it leads its own group.
  while ((${#SETSID[@]})) && ((waited < 50)) && [[ -r "/proc/${pid}/stat" ]] &&
    [[ "$(cut -d' ' -f5 "/proc/${pid}/stat" 2>/dev/null)" != "${pid}" ]]; do
    sleep 0.02
    waited=$((waited + 1))
  done
  NAMES+=("${name}")
  PIDS+=("${pid}")
  LOGS+=("${log}")
  deliver_signals
  say "started ${name} pid=${pid} log=${log} env:${staged:- (no staging variables)}"
}

# True while the process, or (with setsid) any process of its group, runs. A reaped process's
# PID is not looked at (it may be reused), only its group: Linux never reuses the PID of a live
# group's ID.
group_running() {
  local pid="$1" stat rest
  if [[ -z "${REAPED[${pid}]+set}" ]] && proc_running "${pid}"; then
    return 0
  fi
  ((${#SETSID[@]})) || return 1
  for stat in /proc/[0-9]*/stat; do
    { read -r rest <"${stat}"; } 2>/dev/null || continue
    rest="${rest##*) }" # state ppid pgrp ...
    read -r -a rest <<<"${rest}"
    if [[ "${rest[2]}" == "${pid}" && "${rest[0]}" != [ZX] ]]; then
      return 0
    fi
  done
  return 1
}

# Sends a signal to a started process, and to its group when it has one.
signal_process() {
  local sig="$1" pid="$2"
  if ((${#SETSID[@]})); then
    kill "-${sig}" -- "-${pid}" 2>/dev/null || kill "-${sig}" "${pid}" 2>/dev/null || true
  else
    kill "-${sig}" "${pid}" 2>/dev/null || true
  fi
}

# Stops every started process at once: SIGTERM to all, one shared wait of STOP_GRACE seconds,
# then SIGKILL (said, per process) to whatever still runs; reaps each and reports its status.
stop_all() {
  local i pid ticks=0 live=() rc
  declare -A signalled=()
  for i in "${!PIDS[@]}"; do
    pid="${PIDS[i]}"
    if group_running "${pid}"; then
      signal_process TERM "${pid}"
      live+=("${i}")
      signalled["${pid}"]=1
    fi
  done
  while ((${#live[@]})) && ((ticks < STOP_GRACE * 10)); do
    local still=()
    for i in "${live[@]}"; do
      group_running "${PIDS[i]}" && still+=("${i}")
    done
    live=(${still[@]+"${still[@]}"})
    ((${#live[@]})) || break
    sleep 0.1
    ticks=$((ticks + 1))
  done
  for i in ${live[@]+"${live[@]}"}; do
    if group_running "${PIDS[i]}"; then
      say "${NAMES[i]} pid=${PIDS[i]} ignored SIGTERM for ${STOP_GRACE}s; sending SIGKILL"
      signal_process KILL "${PIDS[i]}"
      # SIGKILL cannot be ignored; wait (bounded) until the kernel has taken the group down.
      ticks=0
      while group_running "${PIDS[i]}" && ((ticks < 50)); do
        sleep 0.1
        ticks=$((ticks + 1))
      done
    fi
  done
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    pid="${PIDS[i]}"
    [[ -z "${REAPED[${pid}]+set}" ]] || continue
    rc=0
    wait "${pid}" 2>/dev/null || rc=$?
    REAPED["${pid}"]="${rc}"
    if [[ -n "${signalled[${pid}]+set}" ]]; then
      say "stopped ${NAMES[i]} pid=${pid} (exit ${rc})"
    else
      say "${NAMES[i]} pid=${pid} had exited (exit ${rc})"
    fi
  done
}

print_log_tails() {
  local i
  for i in "${!NAMES[@]}"; do
    echo "----- ${NAMES[i]} (${LOGS[i]}), last 40 lines -----" >&2
    tail -n 40 "${LOGS[i]}" >&2 2>/dev/null || echo "(no log)" >&2
  done
}

on_exit() {
  local rc=$?
  set +e
  # A signal's trap can run inside a command whose stderr is redirected (e.g. a `read ...
  # 2>/dev/null`), and its exit keeps that redirection: write to the launcher's own stderr.
  exec 2>&"${LAUNCHER_STDERR}"
  trap '' INT TERM HUP # one clean stop: a second Ctrl-C does not cut it short
  stop_all
  if ((rc != 0)); then
    print_log_tails
    echo "${PROG}: job failed (exit ${rc}); logs in ${LOG_DIR}" >&2
  else
    say "job succeeded; logs in ${LOG_DIR}"
  fi
  exit "${rc}"
}
# A signal says "interrupted" and exits with 128 + its number, through on_exit.
on_signal() {
  echo "${PROG}: interrupted by SIG$1; stopping every process it started" >&"${LAUNCHER_STDERR}"
  exit "$2"
}
deliver_signals() {
  trap 'on_signal HUP 129' HUP
  trap 'on_signal INT 130' INT
  trap 'on_signal TERM 143' TERM
  if ((DEFERRED_EXIT)); then
    on_signal "${DEFERRED_SIGNAL}" "${DEFERRED_EXIT}"
  fi
}
defer_signals() {
  trap 'DEFERRED_SIGNAL=HUP DEFERRED_EXIT=129' HUP
  trap 'DEFERRED_SIGNAL=INT DEFERRED_EXIT=130' INT
  trap 'DEFERRED_SIGNAL=TERM DEFERRED_EXIT=143' TERM
}
DEFERRED_EXIT=0
DEFERRED_SIGNAL=""
exec {LAUNCHER_STDERR}>&2 # the launcher's stderr, for its signal and exit traps
trap on_exit EXIT
deliver_signals

fail() {
  echo "${PROG}: error: $*" >&2
  exit 1
}

# Waits until the process's log has a line "READY <host>:<port>"; sets READY_ADDR to the address.
# (Not in a command substitution: the launcher must stay able to act on a signal meanwhile.)
wait_ready() {
  local name="$1" pid="$2" log="$3" line deadline=$((SECONDS + STARTUP_TIMEOUT))
  while true; do
    line="$(grep -m1 '^READY ' "${log}" 2>/dev/null || true)"
    if [[ -n "${line}" ]]; then
      READY_ADDR="${line#READY }"
      return 0
    fi
    proc_running "${pid}" || fail "${name} exited before it was ready"
    ((SECONDS < deadline)) || fail "${name} was not ready after ${STARTUP_TIMEOUT}s"
    check_job_deadline
    sleep 0.1
  done
}

check_job_deadline() {
  if ((TIMEOUT > 0 && SECONDS >= JOB_DEADLINE)); then
    fail "the job did not finish within ${TIMEOUT}s"
  fi
}

# Waits for the job: until the process named $1 exits; any other process exiting first, or the
# --timeout passing, fails the job. Returns the job process's exit status.
wait_job() {
  local job_name="$1" job_pid="" i rc=0
  for i in "${!NAMES[@]}"; do
    [[ "${NAMES[i]}" != "${job_name}" ]] || job_pid="${PIDS[i]}"
  done
  while proc_running "${job_pid}"; do
    for i in "${!NAMES[@]}"; do
      if [[ "${PIDS[i]}" != "${job_pid}" ]] && ! proc_running "${PIDS[i]}"; then
        fail "${NAMES[i]} pid=${PIDS[i]} exited while the job was running"
      fi
    done
    check_job_deadline
    sleep 0.2
  done
  wait "${job_pid}" || rc=$?
  REAPED["${job_pid}"]="${rc}"
  # Its summary (a driver's "NAME: OK: ..." or "NAME: FAILED: ..." line), else its last line.
  local log="${LOG_DIR}/${job_name}.log" summary
  summary="$(grep -E '^[[:alnum:]_]+: (OK|FAILED): ' "${log}" 2>/dev/null | tail -n 1 || true)"
  if [[ -n "${summary}" ]]; then
    say "${job_name} pid=${job_pid} exited ${rc}; its summary:"
    printf '  %s\n' "${summary}"
  else
    say "${job_name} pid=${job_pid} exited ${rc}; last line of its log:"
    tail -n 1 "${log}" | sed 's/^/  /'
  fi
  return "${rc}"
}

say "host=${HOST} python=${PYTHON} logs=${LOG_DIR}"
say "staging: TUNIX_STAGE_BATCH=${TUNIX_STAGE_BATCH}" \
  "TUNIX_MAX_STAGED_BATCHES=${TUNIX_MAX_STAGED_BATCHES}" \
  "TUNIX_STAGE_MAX_DEVICE_BATCHES=${TUNIX_STAGE_MAX_DEVICE_BATCHES}" \
  "TUNIX_STAGE_MAX_HOST_BATCHES=${TUNIX_STAGE_MAX_HOST_BATCHES}"
if [[ "${HOST}" == tunix ]] && ((CONTAINER_MAINS)); then
  say "tunix's runtime (${RUNTIME_MAIN}) runs ORCHESTRATOR_MAIN=${ORCHESTRATOR_MAIN}" \
    "TRAINER_MAIN=${TRAINER_MAIN} ROLLOUT_MAIN=${ROLLOUT_MAIN}"
elif [[ "${HOST}" == tunix ]]; then
  say "tunix's runtime (${RUNTIME_MAIN}) runs the plugin's small tunix job (${TUNIX_JOB})"
fi

if [[ "${HOST}" == embedded ]]; then
  # --port 0: the trainer binds a free port itself and names it in its READY line.
  start_process trainer trainer "${PYTHON}" -m "${EMBEDDED_TRAINER}" --port "${PORT:-0}"
  wait_ready trainer "${PIDS[0]}" "${LOGS[0]}"
  TRAINER_ADDR="${READY_ADDR}"
  [[ "${TRAINER_ADDR}" == "${LOCALHOST}:"* ]] ||
    fail "trainer reported '${TRAINER_ADDR}', not an address on ${LOCALHOST}"
  say "trainer ready on ${TRAINER_ADDR}"
  ORCH_ARGS=(--trainer "${TRAINER_ADDR}")
  [[ -z "${STEPS}" ]] || ORCH_ARGS+=(--steps "${STEPS}")
  [[ -z "${MICROBATCHES}" ]] || ORCH_ARGS+=(--microbatches "${MICROBATCHES}")
  ((TINY == 0)) || ORCH_ARGS+=(--tiny)
  # The embedded orchestrator is a driver known to take the staging flags (none when staging is
  # off), as tunix's known drivers are in the orchestrator's container.
  stage_flags=()
  if ! embedded_flags="$(mlperf_driver_flags "${EMBEDDED_ORCHESTRATOR}")"; then
    die "could not read the orchestrator's flags from 'tunix-stage config --flags_for'"
  fi
  [[ -z "${embedded_flags}" ]] || mapfile -t stage_flags <<<"${embedded_flags}"
  start_process orchestrator orchestrator "${PYTHON}" -m "${EMBEDDED_ORCHESTRATOR}" \
    "${ORCH_ARGS[@]}" ${stage_flags[@]+"${stage_flags[@]}"} \
    ${EXTRA_ORCH_ARGS[@]+"${EXTRA_ORCH_ARGS[@]}"}
elif ((CONTAINER_MAINS == 0)); then
  # tunix's small job: the orchestrator's discovery service, which the trainer registers with.
  ORCHESTRATOR_PORT="$(free_port)"
  orch_args=("--discovery_id=${ORCHESTRATOR_ID}" "--discovery_port=${ORCHESTRATOR_PORT}"
    "--process_main=${TUNIX_JOB}.orchestrator_main" --connect_timeout_s "${STARTUP_TIMEOUT}")
  [[ -z "${STEPS}" ]] || orch_args+=(--steps "${STEPS}")
  trainer_args=("--discovery_addrs=${LOCALHOST}:${ORCHESTRATOR_PORT}"
    "--process_main=${TUNIX_JOB}.trainer_main" --worker_id "${TRAINER_ID}" --port "${PORT:-0}")
  [[ -z "${MICROBATCHES}" ]] || trainer_args+=(--microbatches "${MICROBATCHES}")
  ((TINY == 0)) || trainer_args+=(--tiny)
  start_process orchestrator orchestrator "${PYTHON}" -m "${RUNTIME_MAIN}" "${orch_args[@]}"
  start_process trainer trainer "${PYTHON}" -m "${RUNTIME_MAIN}" "${trainer_args[@]}"
else
  ORCHESTRATOR_PORT="$(free_port)"
  TRAINER_PORT="${PORT:-$(free_port)}"
  ROLLOUT_PORT="$(free_port)"
  [[ -z "${STEPS}" ]] || MAX_STEPS="${STEPS}"
  for role in orchestrator trainer rollout; do
    mapfile -t args < <(mlperf_runtime_args "${role}" "${LOCALHOST}" 0 "")
    start_process "${role}" "${role}" "${PYTHON}" -m "${RUNTIME_MAIN}" "${args[@]}"
  done
fi

wait_job orchestrator
