#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Starts or stops one tunix RL job on Kubernetes as JobSets, with micro-batch staging switched on
# or off by the environment (see mlperf_base.sh for every knob and its default).
#
# One JobSet per role: the orchestrator on a CPU node, the trainer and the rollout on TPU slices
# (the rollout: one JobSet per replica, ROLLOUT_REPLICAS, default 1). The staging variables reach
# the containers through each container's `env`:
#   orchestrator: TUNIX_STAGE_BATCH, TUNIX_MAX_STAGED_BATCHES, TUNIX_STAGE_CODEC,
#                 TUNIX_STAGE_ACCEPT_TRAIN_STAGE, TUNIX_STAGE_METRICS, TUNIX_STAGE_LOG_EVERY,
#                 TUNIX_STAGE_MEMORY_BUDGET (where set)
#                 (+ --stage_train_batches=stage --max_staged_batches=N when on,
#                 --stage_codec=C when a codec is set, if ORCHESTRATOR_MAIN is a driver known
#                 to take them: `tunix-stage config --driver MAIN`; any other gets the env only)
#   trainer:      TUNIX_STAGE_BATCH, TUNIX_STAGE_MAX_DEVICE_BATCHES, TUNIX_STAGE_MAX_HOST_BATCHES,
#                 TUNIX_STAGE_ACCEPT_TRAIN_STAGE, TUNIX_STAGE_METRICS, TUNIX_STAGE_LOG_EVERY,
#                 TUNIX_STAGE_MEMORY_BUDGET (where set)
# (the plugin's settings table decides which: `tunix-stage config --env_for ROLE`)
#   rollout:      none
# With staging off the containers carry TUNIX_STAGE_BATCH=off and no staging flag.
set -euo pipefail

RECIPES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=cli_lib.sh
source "${RECIPES_DIR}/cli_lib.sh"
PROG="k8s_launcher.sh"

usage() {
  cat <<EOF
usage: ${PROG} --command start|stop [--role orchestrator|trainer|rollout|all] [--image IMAGE]
                     [--dry_run] [-h|--help]

Renders one JobSet manifest per role and pipes it to 'kubectl apply -f -' (start first deletes
the role's running JobSets), or deletes the role's JobSets (stop).

options:
  --command start|stop   what to do (required)
  --role ROLE            orchestrator, trainer, rollout or all (default: all)
  --image IMAGE          container image with tunix and tunix-stage-plugin installed
                         (default: \$TUNIX_IMAGE; required by start)
  --dry_run              print the manifests (start) or the kubectl commands (stop) and touch
                         nothing; kubectl is not needed
  -h, --help             show this help and exit

staging (validated by 'tunix-stage config --check'; a bad value stops the launcher):
  TUNIX_STAGE_BATCH               off | stage (default off)
  TUNIX_MAX_STAGED_BATCHES        orchestrator's stage-ahead depth, 1..1024 or auto (default auto, from 2)
  TUNIX_STAGE_MAX_DEVICE_BATCHES  trainer's device-memory bound, 1..1024 (default 1)
  TUNIX_STAGE_MAX_HOST_BATCHES    trainer's received-batch host bound, 1..1024 or auto (default auto, from 1)
  TUNIX_STAGE_CODEC               orchestrator's stage payload codec, off | on | NAME[:LEVEL] (default off)
  TUNIX_STAGE_ACCEPT_TRAIN_STAGE  the fingerprint of a changed tunix train loop to stage anyway,
                                  as its refusal line prints it (default none; docs/tunix.md)
  TUNIX_STAGE_METRICS             a folder in each container for its per-step metrics record
                                  (default none; docs/observability.md)
  TUNIX_STAGE_LOG_EVERY           the per-step line every N steps, 0 none (default 1)
  TUNIX_STAGE_MEMORY_BUDGET       the bytes a process's staged micro-batches may hold at auto,
                                  e.g. 6GiB (default a quarter of each machine's memory)

Every other knob (JOB_NAME, ports, model, TPU shape, ...) is listed in mlperf_base.sh.
KUBECTL_FLAGS (e.g. "--context=my-cluster --namespace=rl") goes before every kubectl command.
example:
  TUNIX_STAGE_BATCH=stage ${PROG} --command start --image IMAGE --dry_run
EOF
}

COMMAND=""
ROLE="all"
DRY_RUN=0
IMAGE_ARG=""

while (($# > 0)); do
  set -- "$(canonical_flag "$1")" "${@:2}"
  case "$1" in
    --command=*) COMMAND="${1#*=}"; shift ;;
    --command) COMMAND="$(option_value "$1" "$#" "${2-}")"; shift 2 ;;
    --role=*) ROLE="${1#*=}"; shift ;;
    --role) ROLE="$(option_value "$1" "$#" "${2-}")"; shift 2 ;;
    --image=*) IMAGE_ARG="${1#*=}"; shift ;;
    --image) IMAGE_ARG="$(option_value "$1" "$#" "${2-}")"; shift 2 ;;
    --dry_run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage_error "unknown option '$1'" ;;
  esac
done

case "${COMMAND}" in
  start | stop) ;;
  "") usage_error "--command is required (start or stop)" ;;
  *) usage_error "--command must be start or stop, not '${COMMAND}'" ;;
esac
case "${ROLE}" in
  orchestrator | trainer | rollout) ROLES=("${ROLE}") ;;
  all) ROLES=(orchestrator trainer rollout) ;;
  *) usage_error "--role must be orchestrator, trainer, rollout or all, not '${ROLE}'" ;;
esac
if [[ -n "${IMAGE_ARG}" ]]; then
  TUNIX_IMAGE="${IMAGE_ARG}"
fi

# Defaults, and the staging values validated by the plugin (stops with its message when bad).
# shellcheck source=mlperf_base.sh
source "${RECIPES_DIR}/mlperf_base.sh"
# Flags for every kubectl call, split on whitespace, e.g. "--context=my-cluster --namespace=rl".
KUBECTL_FLAGS="${KUBECTL_FLAGS:-}"

# --- checks on the job's own knobs --------------------------------------------------------------

check_dns_label() {
  local name="$1" value="$2"
  if ! [[ "${value}" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || ((${#value} > 63)); then
    die "${name}='${value}' is not a valid Kubernetes name; accepted: lowercase letters, digits" \
      "and '-', starting with a letter, at most 63 characters"
  fi
}

check_positive_int() {
  local name="$1" value="$2"
  if ! [[ "${value}" =~ ^[1-9][0-9]*$ ]]; then
    die "${name}='${value}' is invalid; accepted: an integer >= 1"
  fi
}

check_dns_label JOB_NAME "${JOB_NAME}"
check_dns_label ORCHESTRATOR_ID "${ORCHESTRATOR_ID}"
check_dns_label TRAINER_ID "${TRAINER_ID}"
check_dns_label ROLLOUT_ID "${ROLLOUT_ID}"
for knob in ORCHESTRATOR_PORT TRAINER_PORT ROLLOUT_PORT TRAINER_TPU_HOSTS \
  TRAINER_TPU_CHIPS_PER_HOST ROLLOUT_TPU_HOSTS ROLLOUT_TPU_CHIPS_PER_HOST ROLLOUT_REPLICAS; do
  check_positive_int "${knob}" "${!knob}"
done
for knob in ORCHESTRATOR_PORT TRAINER_PORT ROLLOUT_PORT; do
  port="${!knob}"
  if ((${#port} > 5 || 10#${port} > 65535)); then
    die "${knob}='${!knob}' is invalid; accepted: a port, 1..65535"
  fi
done
# Every knob rendered into a manifest was checked for control characters by mlperf_base.sh.
check_no_control KUBECTL_FLAGS "${KUBECTL_FLAGS}"
if [[ "${COMMAND}" == start && -z "${TUNIX_IMAGE}" ]]; then
  die "no image: pass --image IMAGE or set TUNIX_IMAGE (an image with tunix and" \
    "tunix-stage-plugin installed)"
fi

# --- YAML rendering ----------------------------------------------------------------------------

# A YAML double-quoted scalar, which a YAML reader takes back byte for byte: no value with a control
# character, a line separator or an invisible character gets here (the knobs: mlperf_check_knobs;
# the staging values: the plugin's rule for every setting), so only \ and " need escaping.
yaml_str() {
  local s="$1"
  s="${s//\\/\\\\}"
  s="${s//\"/\\\"}"
  printf '"%s"' "${s}"
}

# Prints a YAML sequence of strings, one "- item" per line, each line prefixed by $1.
yaml_list() {
  local indent="$1" item
  shift
  for item in "$@"; do
    printf '%s- %s\n' "${indent}" "$(yaml_str "${item}")"
  done
}

# Prints a container's env block (the role's staging variables), each line prefixed by $2.
yaml_stage_env() {
  local role="$1" indent="$2" names name
  names="$(mlperf_stage_env_names "${role}")"
  if [[ -z "${names}" ]]; then
    printf '%senv: []\n' "${indent}"
    return
  fi
  printf '%senv:\n' "${indent}"
  for name in ${names}; do
    printf '%s  - name: %s\n%s    value: %s\n' "${indent}" "${name}" "${indent}" \
      "$(yaml_str "${!name}")"
  done
}

# The container command of a role (one argument per line, for mapfile).
role_command() {
  local role="$1" replica="${2:-0}" executor="${RUNTIME_EXECUTOR}"
  if [[ "${role}" == orchestrator ]]; then
    executor=""
  fi
  printf '%s\n' "${CONTAINER_PYTHON}" -m "${RUNTIME_MAIN}"
  mlperf_runtime_args "${role}" "${ORCHESTRATOR_ID}" "${replica}" "${executor}"
}

# Prints one JobSet document.
#   $1 role, $2 JobSet name, $3 replica index (rollout), $4 port
render_jobset() {
  local role="$1" name="$2" replica="$3" port="$4"
  local command=() hosts=1 node_selector resources="" annotations=""
  mapfile -t command < <(role_command "${role}" "${replica}")
  if [[ "${role}" == orchestrator ]]; then
    node_selector="                node.kubernetes.io/instance-type: $(yaml_str "${CPU_MACHINE}")"
  else
    local prefix="${role^^}"
    local accel_var="${prefix}_TPU_ACCELERATOR" topo_var="${prefix}_TPU_TOPOLOGY"
    local hosts_var="${prefix}_TPU_HOSTS" chips_var="${prefix}_TPU_CHIPS_PER_HOST"
    hosts="${!hosts_var}"
    node_selector="                cloud.google.com/gke-tpu-accelerator: $(yaml_str "${!accel_var}")
                cloud.google.com/gke-tpu-topology: $(yaml_str "${!topo_var}")"
    # One TPU job per node pool: the slice's hosts must not be shared with another JobSet.
    annotations="  annotations:
    alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool
"
    resources="                  resources:
                    limits:
                      google.com/tpu: ${!chips_var}"
  fi
  cat <<EOF
---
# ${PROG}: role=${role} TUNIX_STAGE_BATCH=${TUNIX_STAGE_BATCH}
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: $(yaml_str "${name}")
  labels:
    app.kubernetes.io/name: tunix-stage
    app.kubernetes.io/instance: $(yaml_str "${JOB_NAME}")
    app.kubernetes.io/component: ${role}
${annotations}spec:
  failurePolicy:
    maxRestarts: 0
  network:
    enableDNSHostnames: true
  replicatedJobs:
    - name: ${role}
      replicas: 1
      template:
        spec:
          parallelism: ${hosts}
          completions: ${hosts}
          completionMode: Indexed
          backoffLimit: 0
          template:
            spec:
              restartPolicy: Never
              nodeSelector:
${node_selector}
              containers:
                - name: ${role}
                  image: $(yaml_str "${TUNIX_IMAGE}")
                  imagePullPolicy: Always
                  ports:
                    - containerPort: ${port}
$(yaml_stage_env "${role}" "                  ")
                  command:
$(yaml_list "                    " "${command[@]}")
EOF
  if [[ -n "${resources}" ]]; then
    printf '%s\n' "${resources}"
  fi
}

# Prints the manifests of a role (the rollout: one per replica).
render_role() {
  local role="$1" i
  case "${role}" in
    orchestrator) render_jobset orchestrator "${ORCHESTRATOR_ID}" 0 "${ORCHESTRATOR_PORT}" ;;
    trainer) render_jobset trainer "${TRAINER_ID}" 0 "${TRAINER_PORT}" ;;
    rollout)
      for ((i = 0; i < ROLLOUT_REPLICAS; i++)); do
        render_jobset rollout "${ROLLOUT_ID}-${i}" "${i}" "${ROLLOUT_PORT}"
      done
      ;;
  esac
}

# --- kubectl ------------------------------------------------------------------------------------

# The kubectl arguments that delete a role's JobSets (all replicas, by label).
delete_args() {
  printf '%s\n' delete jobset \
    -l "app.kubernetes.io/name=tunix-stage,app.kubernetes.io/instance=${JOB_NAME},app.kubernetes.io/component=$1" \
    --ignore-not-found
}

read -r -a KUBECTL_FLAG_ARGS <<<"${KUBECTL_FLAGS}"

# Renders every manifest before kubectl runs at all, so a rendering error changes nothing.
declare -A MANIFESTS=()
if [[ "${COMMAND}" == start ]]; then
  for role in "${ROLES[@]}"; do
    MANIFESTS["${role}"]="$(render_role "${role}")"
  done
fi

if ((DRY_RUN)); then
  echo "# ${PROG}: dry run, nothing applied; TUNIX_STAGE_BATCH=${TUNIX_STAGE_BATCH}" \
    "TUNIX_MAX_STAGED_BATCHES=${TUNIX_MAX_STAGED_BATCHES}" \
    "TUNIX_STAGE_MAX_DEVICE_BATCHES=${TUNIX_STAGE_MAX_DEVICE_BATCHES}" \
    "TUNIX_STAGE_MAX_HOST_BATCHES=${TUNIX_STAGE_MAX_HOST_BATCHES}" >&2
  for role in "${ROLES[@]}"; do
    if [[ "${COMMAND}" == start ]]; then
      printf '%s\n' "${MANIFESTS[${role}]}"
    else
      mapfile -t args < <(delete_args "${role}")
      printf 'kubectl'
      for arg in ${KUBECTL_FLAG_ARGS[@]+"${KUBECTL_FLAG_ARGS[@]}"} "${args[@]}"; do
        printf ' %s' "$(mlperf_shell_word "${arg}")"
      done
      printf '\n'
    fi
  done
  exit 0
fi

if ! command -v kubectl >/dev/null 2>&1; then
  die "kubectl not found on PATH (use --dry_run to only print the manifests)"
fi
kubectl() {
  command kubectl ${KUBECTL_FLAG_ARGS[@]+"${KUBECTL_FLAG_ARGS[@]}"} "$@"
}
# start restarts: every selected role is deleted first (JobSet specs cannot be updated in place),
# then each is applied, orchestrator first.
for role in "${ROLES[@]}"; do
  mapfile -t args < <(delete_args "${role}")
  kubectl "${args[@]}"
done
if [[ "${COMMAND}" == start ]]; then
  for role in "${ROLES[@]}"; do
    printf '%s\n' "${MANIFESTS[${role}]}" | kubectl apply -f -
  done
fi
