# Shared helpers for the launch scripts (sourced, not run).
# shellcheck shell=bash

# Print the calling script's header comment (everything between the shebang and `set -euo pipefail`).
usage() {
  sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'
}

# usage + "error: ..." on stderr, exit 2 (a wrong argument).
usage_error() {
  usage >&2
  echo "error: $*" >&2
  exit 2
}

# "error: ..." on stderr, exit 1 (a problem with the environment, not the arguments).
die() {
  echo "error: $*" >&2
  exit 1
}

# need_value OPTION "$#": an option that takes a value must have one.
need_value() {
  [ "$2" -ge 2 ] || usage_error "$1 needs a value"
}

# need_int NAME VALUE: a positive integer, else a usage error.
need_int() {
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || usage_error "$1 must be a positive integer, got '$2'"
}

# A TCP port nobody listens on right now (the kernel picks it).
free_port() {
  "${PYTHON:-python}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# port_in_use PORT: true if something on this machine already listens on PORT.
port_in_use() {
  "${PYTHON:-python}" - "$1" <<'PY'
import socket, sys
s = socket.socket()
try:
    s.bind(("", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)
PY
}

# check_port_free PORT HOW: a one-line error if a local port is taken (stale run after Ctrl-C?).
check_port_free() {
  if port_in_use "$1"; then
    die "port $1 is already in use on $(hostname) (a previous run still alive, e.g. after Ctrl-C? \
find it with 'ss -ltnp | grep :$1' and kill it, or $2)"
  fi
}

# Number of visible NVIDIA GPUs (0 without nvidia-smi), honouring CUDA_VISIBLE_DEVICES.
gpu_count() {
  if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    if [ -z "$CUDA_VISIBLE_DEVICES" ]; then echo 0; else echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .; fi
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

# Processes per node: $NPROC_PER_NODE, else one per GPU, else 1.
default_nproc() {
  local n
  n=$(gpu_count)
  echo "${NPROC_PER_NODE:-$([ "$n" -gt 0 ] && echo "$n" || echo 1)}"
}

# The train script must exist (a typo otherwise shows up as N identical Python errors).
check_train_script() {
  [ -n "${1:-}" ] || usage_error "missing TRAIN_SCRIPT"
  case "$1" in
    -m) return 0 ;;  # python -m module
    -*) usage_error "unknown option $1" ;;
  esac
  [ -f "$1" ] || die "train script $1 not found (paths are relative to $(pwd))"
}

# Show the command, then replace this shell with it (signals go straight to it).
run_exec() {
  echo "+ $*" >&2
  exec "$@"
}
