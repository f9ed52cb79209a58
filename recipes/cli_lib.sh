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

# Takes an option's value from the next argument; fails when there is none.
# Usage: value="$(option_value --name "$#" "${2-}")"
option_value() {
  local name="$1" next_count="$2" next="${3-}"
  if ((next_count < 2)) || [[ "${next}" == --* ]]; then
    usage_error "${name} needs a value"
  fi
  printf '%s' "${next}"
}
