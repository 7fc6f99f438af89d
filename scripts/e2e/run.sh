#!/usr/bin/env bash
# `make e2e`: ray up -> serve deploy -> a completion through the SDK -> serve status
# -> ray down, with ray_configs/cluster.yaml and ray_configs/serve.yaml as shipped,
# on a cluster whose one node is this machine, reached over SSH on 127.0.0.1.
#
# Here: install openssh-server and rsync if missing, build a wheelhouse for the
# node's `make install` (the node itself has no network), then run
# scripts/e2e/sandbox.sh in new network, PID and mount namespaces (it explains
# why). Needs root. Prints PASS or FAIL and exits non-zero on failure; keeps its
# work folder only with FLOTILLA_E2E_KEEP=1.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=$REPO/.venv/bin/python
TORCH=${TORCH:-torch==2.13.0}          # the Makefile's pin: what the node's `make install` asks for
T0=$SECONDS
WORK=
NS_PID=

say() { echo "[e2e] $*"; }

finish() {
  local rc=$?
  if [[ -n $NS_PID ]]; then
    # Interrupted. unshare blocks SIGTERM; SIGKILL it and --kill-child SIGKILLs the
    # sandbox, PID 1 of the namespace, which takes every process in it along.
    kill -KILL "$NS_PID" 2>/dev/null || true
    wait "$NS_PID" 2>/dev/null || true
  fi
  if [[ -n $WORK && ${FLOTILLA_E2E_KEEP:-0} != 1 ]]; then
    rm -rf "$WORK"
  elif [[ -n $WORK ]]; then
    say "kept $WORK"
  fi
  if ((rc == 0)); then say "PASS ($((SECONDS - T0))s)"; else say "FAIL (exit $rc after $((SECONDS - T0))s)"; fi
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT TERM

[[ $(id -u) == 0 ]] || { say "needs root (apt-get, namespaces)"; exit 1; }
[[ -x $PY ]] || { say "no $PY: run 'make install' first"; exit 1; }

need=()
[[ -x /usr/sbin/sshd ]] || need+=(openssh-server)
command -v rsync >/dev/null || need+=(rsync)
command -v ip >/dev/null || need+=(iproute2)
command -v make >/dev/null || need+=(make)
/usr/bin/python3 -c 'import ensurepip' 2>/dev/null || need+=(python3 python3-venv)
if ((${#need[@]})); then
  say "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq "${need[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null; }
fi

WORK=$(mktemp -d /var/tmp/flotilla-e2e.XXXXXX)
mkdir -p "$WORK/logs"
t0=$SECONDS
"$PY" "$REPO/scripts/e2e/node_requirements.py" "$REPO/pyproject.toml" "$TORCH" >"$WORK/node-requirements.txt"
if ! "$PY" -m pip wheel -q -w "$WORK/wheelhouse" -r "$WORK/node-requirements.txt" >"$WORK/logs/wheelhouse.log" 2>&1; then
  say "wheelhouse FAILED; end of its log:"
  tail -n 40 "$WORK/logs/wheelhouse.log" | sed 's/^/    /'
  exit 1
fi
say "wheelhouse ok ($(find "$WORK/wheelhouse" -name '*.whl' | wc -l) wheels, $((SECONDS - t0))s)"

unshare --net --pid --mount --fork --kill-child --mount-proc \
  bash "$REPO/scripts/e2e/sandbox.sh" "$WORK" "$REPO" &
NS_PID=$!
wait "$NS_PID"
NS_PID=
