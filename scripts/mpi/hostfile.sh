# read_hostfile FILE: the hosts of an MPI hostfile into the array HOSTS (sourced, not run).
# Accepts "host", "host:slots" (MPICH / Intel MPI) and "host slots=N" (Open MPI); skips blank
# lines and # comments. HOSTS[0], the first line, is the master (MASTER_ADDR).
# shellcheck shell=bash

read_hostfile() {
  [ -f "$1" ] || usage_error "hostfile $1 not found (one host per line, the master first; -f FILE or HOSTFILE)"
  HOSTS=()
  local line
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line%%#*}
    line=${line%%:*}
    read -r line _ <<<"$line" || true
    [ -z "$line" ] || HOSTS+=("$line")
  done <"$1"
  [ "${#HOSTS[@]}" -gt 0 ] || usage_error "hostfile $1 lists no hosts"
}
