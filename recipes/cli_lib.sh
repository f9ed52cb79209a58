#!/usr/bin/env bash
# Option-parsing helpers shared by the launchers; sourced before mlperf_base.sh, so that --help
# and usage errors work even where the plugin is not installed. The sourcing script sets PROG.

# Prints the error and a pointer to --help; exit 2 (a usage error).
usage_error() {
  echo "${PROG}: error: $*" >&2
  echo "run '${PROG} --help' for usage" >&2
  exit 2
}

# Prints the error; exit 2 (a bad setting).
die() {
  echo "${PROG}: error: $*" >&2
  exit 2
}

# One flag spelling everywhere: underscores, as the plugin's Python entry points and the hosts'
# drivers spell theirs (--stage_train_batches sits next to tunix's and MaxText's flags); a dashed
# flag (--dry-run) is the same flag. Prints ARG with its name's dashes made underscores.
# Usage: set -- "$(canonical_flag "$1")" "${@:2}"
canonical_flag() {
  local arg="$1" name rest=""
  if [[ "${arg}" != --?* ]]; then
    printf '%s' "${arg}"
    return
  fi
  name="${arg:2}"
  if [[ "${name}" == *=* ]]; then
    rest="=${name#*=}"
    name="${name%%=*}"
  fi
  printf -- '--%s%s' "${name//-/_}" "${rest}"
}

# Takes an option's value from the next argument; fails when there is none.
# Usage: value="$(option_value --name "$#" "${2-}")"
option_value() {
  local name="$1" next_count="$2" next="${3-}"
  if ((next_count < 2)) || [[ "${next}" == --* ]]; then
    usage_error "${name} needs a value"
  fi
  printf '%s' "${next}"
}

# Refuses a value holding a newline, tab, CR or any other control character: such a value would
# add or split an argument of a launched command (or break a manifest). Exit 2 (a usage error).
# Usage: check_no_control NAME VALUE
check_no_control() {
  if [[ "$2" == *[[:cntrl:]]* ]]; then
    usage_error "$1=$(printf '%q' "$2") is invalid; accepted: a value without newlines, tabs or" \
      "other control characters"
  fi
}

# Validates a whole number option and stores it normalised (leading zeros dropped, so that bash
# arithmetic never reads "08" as octal). Accepted: ASCII digits only, MIN..MAX. Exit 2 otherwise.
# Usage: uint_option NAME VARIABLE MIN MAX   (the value is read from, and written to, VARIABLE)
uint_option() {
  local name="$1" var="$2" min="$3" max="$4" value digits
  value="${!var}"
  digits="${value#"${value%%[!0]*}"}" # without leading zeros ("" for 0)
  if ! [[ "${value}" =~ ^[0123456789]+$ ]] || ((${#digits} > 9)) ||
    ((10#${digits:-0} < min || 10#${digits:-0} > max)); then
    usage_error "${name} must be an integer >= ${min} and <= ${max}, not" \
      "$(printf '%q' "${value}")"
  fi
  printf -v "${var}" '%d' "$((10#${digits:-0}))"
}
