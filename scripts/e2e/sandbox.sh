#!/usr/bin/env bash
# The body of `make e2e`. scripts/e2e/run.sh starts it as PID 1 of new network,
# PID and mount namespaces (unshare), which keep a shared machine safe:
#   network  only loopback: the node's Ray ports (6379, 8265, 8000, ...) and
#            sshd's port 22 are free whatever else runs here, and nothing leaves;
#   PID      `ray stop` (in the start commands and in `ray down`) sees and stops
#            this node's Ray processes only, never another Ray on the machine;
#   mount    a fresh /tmp, and the node's home ($WORK/node) over root's home,
#            so the node has a disk of its own (~/flotilla, ~/.ray/auth_token)
#            and the client (HOME=$WORK/client) another.
# When this script exits the kernel ends whatever is left in the namespace.
#
#   usage: sandbox.sh WORK REPO       (WORK holds wheelhouse/, filled by run.sh)
set -euo pipefail

WORK=$1
REPO=$2
SSH_PORT=22                          # free: this network namespace is new
DASHBOARD=http://127.0.0.1:8265      # the --dashboard-port of cluster.yaml's head
METRICS=http://127.0.0.1:8080        # its --metrics-export-port
LOGS=$WORK/logs
ROOT_HOME=$(getent passwd "$(id -un)" | cut -d: -f6)
SSHD_PID=
RAY_UP_RAN=

say() { echo "[e2e] $*"; }

# step NAME CMD...: run CMD with its output in $LOGS/NAME.log; on failure show the log's tail.
step() {
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  if ((rc == 0)); then
    say "$name ok ($((SECONDS - t0))s)"
  else
    say "$name FAILED (exit $rc after $((SECONDS - t0))s); end of $LOGS/$name.log:"
    tail -n 60 "$LOGS/$name.log" | sed 's/^/    /'
    return "$rc"
  fi
}

node_logs() {
  local dir=/tmp/ray/session_latest/logs f
  [[ -d $dir ]] || return 0
  for f in "$dir"/raylet.err "$dir"/gcs_server.err "$dir"/monitor.err "$dir"/dashboard.err \
           "$dir"/serve/controller_*.log "$dir"/serve/replica_*.log; do
    [[ -s $f ]] || continue
    say "node log $f (end):"
    tail -n 25 "$f" | sed 's/^/    /'
  done
}

stop_sshd() {
  [[ -n $SSHD_PID ]] || return 0
  kill "$SSHD_PID" 2>/dev/null || true
  wait "$SSHD_PID" 2>/dev/null || true   # our child: returns once it has exited
  SSHD_PID=
}

finish() {
  local rc=$?
  if ((rc != 0)); then
    node_logs
    if [[ -n $RAY_UP_RAN ]]; then
      say "ray down after the failure (log: $LOGS/ray-down-after-failure.log)"
      timeout 180 ray down -y "$WORK/cluster.yaml" >"$LOGS/ray-down-after-failure.log" 2>&1 || true
    fi
  fi
  stop_sshd
  exit "$rc"
}
trap finish EXIT

# --- the namespaces' view ---------------------------------------------------
ip link set lo up
# The node's "image": an empty home whose pip installs from the wheelhouse (no network here).
mkdir -p "$WORK/node/.config/pip" "$WORK/client" "$WORK/ssh" "$LOGS"
printf '[global]\nno-index = true\nfind-links = %s\n' "$WORK/wheelhouse" >"$WORK/node/.config/pip/pip.conf"
# The client needs the checkout and its venv's Python at their own paths: if the
# new /tmp or the node's home would hide them, mount them back on top.
keep=()
for path in "$REPO" "$("$REPO/.venv/bin/python" -c 'import sys; print(sys.base_prefix)')"; do
  case $path in /tmp/* | "$ROOT_HOME"/*) keep+=("$path") ;; esac
done
for i in "${!keep[@]}"; do mkdir -p "$WORK/keep/$i" && mount --bind "${keep[$i]}" "$WORK/keep/$i"; done
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount --bind "$WORK/node" "$ROOT_HOME"
for i in "${!keep[@]}"; do mkdir -p "${keep[$i]}" && mount --bind "$WORK/keep/$i" "${keep[$i]}"; done

# The client: this repo's venv (ray, serve, the flotilla SDK), its own home and token.
export HOME=$WORK/client PATH=$REPO/.venv/bin:$PATH RAY_AUTH_MODE=token
cd "$REPO"

# --- an SSH server on 127.0.0.1, root logs in with a key made for this run ---
ssh-keygen -q -t ed25519 -N '' -C flotilla-e2e-host -f "$WORK/ssh/host_key"
ssh-keygen -q -t ed25519 -N '' -C flotilla-e2e-client -f "$WORK/ssh/id_ed25519"
cp "$WORK/ssh/id_ed25519.pub" "$WORK/ssh/authorized_keys"
cat >"$WORK/ssh/sshd_config" <<EOF
ListenAddress 127.0.0.1:$SSH_PORT
HostKey $WORK/ssh/host_key
AuthorizedKeysFile $WORK/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
EOF
mkdir -p /run/sshd                   # sshd's privilege-separation directory
/usr/sbin/sshd -D -f "$WORK/ssh/sshd_config" -E "$LOGS/sshd-server.log" &
SSHD_PID=$!
# Ready when root logs in with the key; ssh itself retries once a second (ConnectionAttempts).
step sshd ssh -i "$WORK/ssh/id_ed25519" -o BatchMode=yes -o IdentitiesOnly=yes \
  -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectionAttempts=20 \
  -p "$SSH_PORT" "$(id -un)@127.0.0.1" true
say "sshd pid $SSHD_PID on 127.0.0.1:$SSH_PORT"

# --- the cluster --------------------------------------------------------------
step token ray get-auth-token --generate
chmod 600 "$HOME/.ray/auth_token"
step render python scripts/e2e/render_config.py ray_configs/cluster.yaml "$WORK/cluster.yaml" \
  --ssh-user "$(id -un)" --ssh-key "$WORK/ssh/id_ed25519"
RAY_UP_RAN=1
step ray-up ray up -y "$WORK/cluster.yaml" --no-config-cache
cmp -s "$HOME/.ray/auth_token" "$ROOT_HOME/.ray/auth_token" || { say "the token did not reach the node"; exit 1; }
say "the node has the client's token at ~/.ray/auth_token"
step serve-deploy serve deploy ray_configs/serve.yaml -a "$DASHBOARD"
step checks python scripts/e2e/check_serving.py --dashboard "$DASHBOARD" \
  --metrics "$METRICS" --serve-config ray_configs/serve.yaml
sed 's/^/    /' "$LOGS/checks.log"
step ray-down ray down -y "$WORK/cluster.yaml"
RAY_UP_RAN=
step no-ray-left python scripts/e2e/ray_processes.py
stop_sshd
say "sshd stopped"
