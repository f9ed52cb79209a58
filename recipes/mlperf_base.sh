#!/usr/bin/env bash
# Shared defaults for a tunix/MaxText RL job launched with tunix-stage-plugin.
#
# Sourced by k8s_launcher.sh and local_launcher.sh. Every knob is `${VAR:-default}`, so an
# exported value wins and an empty one means "use the default" (as the plugin itself reads them).
# Run it directly (`bash recipes/mlperf_base.sh`) to validate the environment and print the
# effective settings. Sourcing it turns on `set -euo pipefail` in the sourcing shell, as the
# launchers want; source it from a script, not from an interactive shell.
#
# The staging values are validated by the plugin's own rules (`tunix-stage config --check`, run
# with $PYTHON), never re-checked here; a bad one stops with the plugin's one-line message, and a
# missing plugin stops with a message saying so. After validation the three variables hold the
# plugin's normalised values (e.g. " stage" -> "stage", "02" -> "2"), which are what the
# containers and processes receive.
set -euo pipefail

# --- staging (tunix-stage-plugin) -------------------------------------------------------------
# off: the job runs exactly as without the plugin; stage: micro-batches are staged on the
# trainer's device ahead of their train call.
export TUNIX_STAGE_BATCH="${TUNIX_STAGE_BATCH:-off}"
# trainer: how many staged batches may sit in device memory at once.
export TUNIX_STAGE_MAX_DEVICE_BATCHES="${TUNIX_STAGE_MAX_DEVICE_BATCHES:-1}"
# trainer: how many received micro-batches may wait in host memory for a device slot (auto:
# sized each step from 1, within TUNIX_STAGE_MEMORY_BUDGET; 1 fixes it).
export TUNIX_STAGE_MAX_HOST_BATCHES="${TUNIX_STAGE_MAX_HOST_BATCHES:-auto}"
# orchestrator: how many micro-batches to keep staged ahead of the pending train call (auto:
# sized each step from 2, within TUNIX_STAGE_MEMORY_BUDGET; 2 fixes it).
export TUNIX_MAX_STAGED_BATCHES="${TUNIX_MAX_STAGED_BATCHES:-auto}"
# orchestrator: compress staged payloads (off | NAME[:LEVEL]; needs the codec extra).
export TUNIX_STAGE_CODEC="${TUNIX_STAGE_CODEC:-off}"

# --- the job's usual knobs --------------------------------------------------------------------
# The interpreter the recipes run (validation, local processes); default: the first of this
# checkout's .venv/bin/python, the python next to `tunix-stage` on PATH, python3, that has
# tunix-stage-plugin and its dependencies (mlperf_default_python). Containers use
# CONTAINER_PYTHON.
export PYTHON="${PYTHON:-}"
export CONTAINER_PYTHON="${CONTAINER_PYTHON:-python}"
# Names every JobSet: a lowercase DNS label (k8s_launcher.sh checks it).
export JOB_NAME="${JOB_NAME:-tunix-mlperf}"
export ORCHESTRATOR_ID="${ORCHESTRATOR_ID:-${JOB_NAME}-orch}"
export TRAINER_ID="${TRAINER_ID:-${JOB_NAME}-train}"
export ROLLOUT_ID="${ROLLOUT_ID:-${JOB_NAME}-roll}"
export ORCHESTRATOR_PORT="${ORCHESTRATOR_PORT:-20000}"
export ROLLOUT_PORT="${ROLLOUT_PORT:-20001}"
export TRAINER_PORT="${TRAINER_PORT:-20002}"

# tunix's distributed runtime runs each role's process_main.
export RUNTIME_MAIN="${RUNTIME_MAIN:-tunix.experimental.distributed.runtime.main}"
export RUNTIME_EXECUTOR="${RUNTIME_EXECUTOR:-tunix.experimental.distributed.runtime.executor.K8sExecutor}"
export ORCHESTRATOR_MAIN="${ORCHESTRATOR_MAIN:-tunix.experimental.examples.deepswe_dist.run_deepswe_dist.main}"
export TRAINER_MAIN="${TRAINER_MAIN:-tunix.experimental.examples.deepswe_dist.run_trainer_node.main}"
export ROLLOUT_MAIN="${ROLLOUT_MAIN:-tunix.experimental.examples.deepswe_dist.run_rollout_node.main}"

export MODEL_ID="${MODEL_ID:-Qwen/Qwen3-1.7B}"
export TOKENIZER_PATH="${TOKENIZER_PATH:-${MODEL_ID}}"
export BATCH_SIZE="${BATCH_SIZE:-8}"
export NUM_GENERATIONS="${NUM_GENERATIONS:-4}"
export MAX_STEPS="${MAX_STEPS:-100}"
export MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-1024}"
export MAX_RESPONSE_LENGTH="${MAX_RESPONSE_LENGTH:-1024}"
export TRAIN_MICRO_BATCH_SIZE="${TRAIN_MICRO_BATCH_SIZE:-8}"
export LEARNING_RATE="${LEARNING_RATE:-1.0e-6}"
# Extra driver flags per role, split on whitespace (no quoting inside a flag).
export ORCHESTRATOR_EXTRA_ARGS="${ORCHESTRATOR_EXTRA_ARGS:-}"
export TRAINER_EXTRA_ARGS="${TRAINER_EXTRA_ARGS:-}"
export ROLLOUT_EXTRA_ARGS="${ROLLOUT_EXTRA_ARGS:-}"

# Cluster shape (k8s_launcher.sh).
export TUNIX_IMAGE="${TUNIX_IMAGE:-}"
export CPU_MACHINE="${CPU_MACHINE:-n2-standard-64}"
export TRAINER_TPU_ACCELERATOR="${TRAINER_TPU_ACCELERATOR:-tpu-v5p-slice}"
export TRAINER_TPU_TOPOLOGY="${TRAINER_TPU_TOPOLOGY:-2x2x2}"
export TRAINER_TPU_HOSTS="${TRAINER_TPU_HOSTS:-2}"
export TRAINER_TPU_CHIPS_PER_HOST="${TRAINER_TPU_CHIPS_PER_HOST:-4}"
export ROLLOUT_TPU_ACCELERATOR="${ROLLOUT_TPU_ACCELERATOR:-tpu-v5p-slice}"
export ROLLOUT_TPU_TOPOLOGY="${ROLLOUT_TPU_TOPOLOGY:-2x2x1}"
export ROLLOUT_TPU_HOSTS="${ROLLOUT_TPU_HOSTS:-1}"
export ROLLOUT_TPU_CHIPS_PER_HOST="${ROLLOUT_TPU_CHIPS_PER_HOST:-4}"
export ROLLOUT_REPLICAS="${ROLLOUT_REPLICAS:-1}"

# Every knob above: none may hold a control character. (The staging variables are judged by the
# plugin's one rule for every setting, which refuses a control character naming it, with the
# setting's own line: mlperf_check_staging.)
MLPERF_KNOBS=(PYTHON CONTAINER_PYTHON JOB_NAME ORCHESTRATOR_ID TRAINER_ID ROLLOUT_ID ORCHESTRATOR_PORT ROLLOUT_PORT
  TRAINER_PORT RUNTIME_MAIN RUNTIME_EXECUTOR ORCHESTRATOR_MAIN TRAINER_MAIN ROLLOUT_MAIN MODEL_ID
  TOKENIZER_PATH BATCH_SIZE NUM_GENERATIONS MAX_STEPS MAX_PROMPT_LENGTH MAX_RESPONSE_LENGTH
  TRAIN_MICRO_BATCH_SIZE LEARNING_RATE ORCHESTRATOR_EXTRA_ARGS TRAINER_EXTRA_ARGS
  ROLLOUT_EXTRA_ARGS TUNIX_IMAGE CPU_MACHINE TRAINER_TPU_ACCELERATOR TRAINER_TPU_TOPOLOGY
  TRAINER_TPU_HOSTS TRAINER_TPU_CHIPS_PER_HOST ROLLOUT_TPU_ACCELERATOR ROLLOUT_TPU_TOPOLOGY
  ROLLOUT_TPU_HOSTS ROLLOUT_TPU_CHIPS_PER_HOST ROLLOUT_REPLICAS)

# --- validation and what each role receives ---------------------------------------------------

# Prints an error prefixed with the recipe's name to stderr.
mlperf_error() {
  echo "mlperf_base.sh: error: $*" >&2
}

# Prints a warning prefixed with the recipe's name to stderr.
mlperf_warning() {
  echo "mlperf_base.sh: warning: $*" >&2
}

# Prints $1 as one shell word, which a shell reads back byte for byte: as it is where every
# character is one a shell takes literally (ASCII letters, digits, - _ . / = : , @ % +; "" too),
# else quoted by printf %q (a path with a space or a quote: /tmp/a\ b). For the lines that show
# what a process gets (NAME=value, a flag), one word per entry.
mlperf_shell_word() {
  if [[ "$1" =~ ^[-A-Za-z0-9_./=:,@%+]*$ ]]; then
    printf '%s' "$1"
  else
    printf '%q' "$1"
  fi
}

# This checkout (the recipes' parent folder): where the install hints point.
mlperf_checkout() {
  (cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
}

# Refuses a knob holding a newline, tab, CR or other control character: one would add or split an
# argument of a launched command, or break a rendered manifest. Returns 2 after one line.
mlperf_check_knobs() {
  local knob
  for knob in "${MLPERF_KNOBS[@]}"; do
    if [[ "${!knob}" == *[[:cntrl:]]* ]]; then
      mlperf_error "${knob}=$(printf '%q' "${!knob}") is invalid; accepted: a value without" \
        "newlines, tabs or other control characters"
      return 2
    fi
  done
}

# Whether $1 is an interpreter with tunix-stage-plugin and its runtime dependencies. Run from /,
# so that a checkout in the current directory does not count as installed.
mlperf_python_has_plugin() {
  (cd / && "$1" -c 'import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None
             for m in ("tunix_stage_plugin", "grpc", "jax", "numpy", "cloudpickle")))') \
    >/dev/null 2>&1
}

# Sets PYTHON, when unset or empty, to the first interpreter that has the plugin: this checkout's
# .venv/bin/python, the python next to `tunix-stage` on PATH, python3. Returns 2 after one line
# when none has it.
mlperf_default_python() {
  [[ -z "${PYTHON}" ]] || return 0
  local recipes_dir candidates=() candidate script
  recipes_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  candidates+=("${recipes_dir%/*}/.venv/bin/python")
  if script="$(command -v tunix-stage 2>/dev/null)"; then
    candidates+=("${script%/*}/python")
  fi
  candidates+=(python3)
  for candidate in "${candidates[@]}"; do
    if command -v "${candidate}" >/dev/null 2>&1 && mlperf_python_has_plugin "${candidate}"; then
      PYTHON="$(command -v "${candidate}")"
      export PYTHON
      return 0
    fi
  done
  mlperf_error "no python with tunix-stage-plugin and its dependencies (tried:" \
    "${candidates[*]}); install it (pip install -e $(mlperf_checkout) in a venv) or set PYTHON to an" \
    "interpreter that has it"
  return 2
}

# Validates the staging variables with the plugin's own rules and normalises them.
# Returns 2 (after printing why) on a bad value, a missing interpreter or a missing plugin.
mlperf_check_staging() {
  if ! command -v "${PYTHON}" >/dev/null 2>&1; then
    mlperf_error "python interpreter '${PYTHON}' not found; set PYTHON to the interpreter that" \
      "has tunix-stage-plugin installed"
    return 2
  fi
  if ! mlperf_python_has_plugin "${PYTHON}"; then
    mlperf_error "tunix-stage-plugin is not installed for ${PYTHON} (or its dependencies are" \
      "missing); it runs the job's processes and validates TUNIX_STAGE_BATCH," \
      "TUNIX_MAX_STAGED_BATCHES and the trainer's bounds. Install it (${PYTHON} -m pip" \
      "install -e $(mlperf_checkout)) or set PYTHON to an interpreter that has it."
    return 2
  fi
  local out rc=0 line
  # `tunix-stage config --check`, run with $PYTHON so that it is the plugin that $PYTHON imports.
  out="$("${PYTHON}" -m tunix_stage_plugin.cli.main config --check 2>&1)" || rc=$?
  if ((rc == 0 || rc == 2)); then
    while IFS= read -r line; do # one line per invalid variable, one per unknown one
      case "${line}" in
        "tunix-stage config: warning: "*) mlperf_warning "${line#tunix-stage config: warning: }" ;;
        "tunix-stage config: error: "*)
          mlperf_error "invalid staging setting: ${line#tunix-stage config: error: }" ;;
        ?*) printf '%s\n' "${line}" >&2 ;;
      esac
    done <<<"${out}"
    ((rc == 0)) || return 2
  else
    mlperf_error "'tunix-stage config --check' failed with exit code ${rc}:"
    printf '%s\n' "${out}" >&2
    return 2
  fi
  # The plugin's resolved values, per role, from its own settings table (`tunix-stage config
  # --env_for ROLE`): the recipes name no variable themselves. (Called from an `if`, this function
  # runs without errexit: every failure is checked by hand.)
  local role assignment names
  for role in orchestrator trainer; do
    if ! out="$("${PYTHON}" -m tunix_stage_plugin.cli.main config --env_for "${role}")"; then
      mlperf_error "could not read the ${role}'s settings from 'tunix-stage config --env_for'"
      return 2
    fi
    names=""
    while IFS= read -r assignment; do
      [[ -n "${assignment}" ]] || continue
      export "${assignment?}" # normalised by the plugin (e.g. " 2" -> "2")
      names+="${names:+ }${assignment%%=*}"
    done <<<"${out}"
    if [[ "${role}" == orchestrator ]]; then
      MLPERF_ENV_ORCHESTRATOR="${names}"
    else
      MLPERF_ENV_TRAINER="${names}"
    fi
  done
  if ! MLPERF_ORCHESTRATOR_FLAGS="$(mlperf_driver_flags "${ORCHESTRATOR_MAIN}")"; then
    mlperf_error "could not read the orchestrator's flags from 'tunix-stage config --flags_for'"
    return 2
  fi
}

# The staging flags for the orchestrator driver $1 (a module, or its main as --process_main names
# it), one per line: only when staging is on and $1 is a driver the plugin knows takes them
# (`tunix-stage config --flags_for orchestrator --driver MAIN`). Any other driver gets none and
# reads the staging variables only, so no launch stops at "unrecognized arguments".
mlperf_driver_flags() {
  "${PYTHON}" -m tunix_stage_plugin.cli.main config --flags_for orchestrator --driver "$1"
}

# The staging variables a role's container/process receives, space-separated (the plugin's
# settings table decides: `tunix-stage config --env_for ROLE`); rollout: none (it never sees a
# training batch).
mlperf_stage_env_names() {
  case "$1" in
    orchestrator) echo "${MLPERF_ENV_ORCHESTRATOR}" ;;
    trainer) echo "${MLPERF_ENV_TRAINER}" ;;
    rollout) echo "" ;;
    *)
      mlperf_error "unknown role '$1'; accepted: orchestrator | trainer | rollout"
      return 2
      ;;
  esac
}

# The staging driver flags for a role, one per line; none when staging is off.
# Only the orchestrator's driver (ORCHESTRATOR_MAIN) takes them, and only a driver known to take
# them (mlperf_driver_flags); the trainer reads its bounds from the environment (tunix's trainer
# node rejects flags it does not define).
mlperf_stage_flags() {
  case "$1" in
    orchestrator) [[ -z "${MLPERF_ORCHESTRATOR_FLAGS}" ]] || printf '%s\n' "${MLPERF_ORCHESTRATOR_FLAGS}" ;;
    trainer | rollout) ;;
    *)
      mlperf_error "unknown role '$1'; accepted: orchestrator | trainer | rollout"
      return 2
      ;;
  esac
}

# The arguments of tunix's distributed runtime (`python -m ${RUNTIME_MAIN} ...`) for one role,
# one per line (for mapfile), the staging flags included.
#   $1 role, $2 the orchestrator's host name (discovery), $3 replica index (rollout),
#   $4 the runtime's --process_executor ("" for none: processes run where they start).
mlperf_runtime_args() {
  local role="$1" orch_host="$2" replica="${3:-0}" executor="${4:-}" extra=() stage=()
  mapfile -t stage < <(mlperf_stage_flags "${role}")
  case "${role}" in
    orchestrator)
      read -r -a extra <<<"${ORCHESTRATOR_EXTRA_ARGS}"
      printf '%s\n' "--discovery_id=${ORCHESTRATOR_ID}" \
        "--discovery_port=${ORCHESTRATOR_PORT}" \
        "--process_main=${ORCHESTRATOR_MAIN}" \
        "--model_id=${MODEL_ID}" \
        "--tokenizer_path=${TOKENIZER_PATH}" \
        "--batch_size=${BATCH_SIZE}" \
        "--num_generations=${NUM_GENERATIONS}" \
        "--max_steps=${MAX_STEPS}" \
        "--max_prompt_length=${MAX_PROMPT_LENGTH}" \
        "--max_response_length=${MAX_RESPONSE_LENGTH}" \
        "--train_micro_batch_size=${TRAIN_MICRO_BATCH_SIZE}" \
        "--learning_rate=${LEARNING_RATE}" \
        "--rollout_replicas=${ROLLOUT_REPLICAS}" \
        --stop_workers_on_exit
      ;;
    trainer)
      read -r -a extra <<<"${TRAINER_EXTRA_ARGS}"
      printf '%s\n' "--discovery_addrs=${orch_host}:${ORCHESTRATOR_PORT}" \
        ${executor:+"--process_executor=${executor}"} \
        "--process_main=${TRAINER_MAIN}" \
        "--worker_id=${TRAINER_ID}" \
        "--port=${TRAINER_PORT}" \
        "--model_id=${MODEL_ID}" \
        "--tokenizer_path=${TOKENIZER_PATH}" \
        "--max_prompt_length=${MAX_PROMPT_LENGTH}" \
        "--max_response_length=${MAX_RESPONSE_LENGTH}" \
        "--train_micro_batch_size=${TRAIN_MICRO_BATCH_SIZE}" \
        "--learning_rate=${LEARNING_RATE}"
      ;;
    rollout)
      read -r -a extra <<<"${ROLLOUT_EXTRA_ARGS}"
      printf '%s\n' "--discovery_addrs=${orch_host}:${ORCHESTRATOR_PORT}" \
        ${executor:+"--process_executor=${executor}"} \
        "--process_main=${ROLLOUT_MAIN}" \
        "--worker_id=${ROLLOUT_ID}-${replica}" \
        "--worker_index=$((replica + 1))" \
        "--port=${ROLLOUT_PORT}" \
        "--model_id=${MODEL_ID}" \
        "--tokenizer_path=${TOKENIZER_PATH}" \
        "--max_prompt_length=${MAX_PROMPT_LENGTH}" \
        "--max_response_length=${MAX_RESPONSE_LENGTH}"
      ;;
    *)
      mlperf_error "unknown role '${role}'; accepted: orchestrator | trainer | rollout"
      return 2
      ;;
  esac
  if ((${#stage[@]} + ${#extra[@]} > 0)); then
    printf '%s\n' ${stage[@]+"${stage[@]}"} ${extra[@]+"${extra[@]}"}
  fi
}

MLPERF_BASE_RUN_DIRECTLY=0
if [[ "${BASH_SOURCE[0]}" == "${0}" ]]; then
  MLPERF_BASE_RUN_DIRECTLY=1
fi

if ! mlperf_check_knobs || ! mlperf_default_python || ! mlperf_check_staging; then
  if ((MLPERF_BASE_RUN_DIRECTLY)); then
    exit 2
  fi
  # Sourced: the launcher's `source` fails, which stops it under set -e.
  return 2
fi

if ((MLPERF_BASE_RUN_DIRECTLY)); then
  # (its warnings were printed by the check above)
  "${PYTHON}" -m tunix_stage_plugin.cli.main config 2>/dev/null
  echo "orchestrator driver: $("${PYTHON}" -m tunix_stage_plugin.cli.main config --driver \
    "${ORCHESTRATOR_MAIN}")"
  for role in orchestrator trainer rollout; do
    mapfile -t flags < <(mlperf_stage_flags "${role}")
    words=""
    for flag in ${flags[@]+"${flags[@]}"}; do
      words+="${words:+ }$(mlperf_shell_word "${flag}")" # one shell word per flag
    done
    echo "${role}: env [$(mlperf_stage_env_names "${role}")] flags [${words}]"
  done
fi
