#!/usr/bin/env bash
# Start FleetWatch on its embedded default: SQLite and a filesystem Celery broker in
# FLEETWATCH_DATA_DIR (./data), the simulated fleet (or, with FLEETWATCH_FLEET=real, the
# sources the environment names), the web UI on $HOST:$PORT.
# Runs web (gunicorn), one Celery worker for all queues and Celery beat; once the web answers
# and the worker has collected, prints the URL and the demo login (user and password; the
# password is kept across starts, FLEETWATCH_DEMO_ROTATE=1 makes a new one). Logs are text on
# a terminal, JSON otherwise (FLEETWATCH_LOG_FORMAT chooses).
#
# Stopping: Ctrl-C, SIGTERM, SIGINT or SIGHUP to this script (`make run` execs it, so a TERM
# to make lands here), or any one of the three exiting, stops all three: SIGTERM to each; the
# worker lets its running tasks finish for FLEETWATCH_WORKER_SHUTDOWN_SECONDS (3 here), then
# cancels them; whatever is still there after FLEETWATCH_STOP_SECONDS (10) is killed, each
# child's whole process group (gunicorn's workers, Celery's pool). A second Ctrl-C kills at
# once. The three run in sessions of their own, so a terminal's Ctrl-C reaches this script
# alone and they stop in that order, not each on its own. A step cut off by the stop resumes
# at the next start (manage.py fleetwatch steps-resume), skipping the calls it completed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN=$VENV/bin
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
STOP_SECONDS=${FLEETWATCH_STOP_SECONDS:-10}
export FLEETWATCH_WORKER_SHUTDOWN_SECONDS=${FLEETWATCH_WORKER_SHUTDOWN_SECONDS:-3}
export DJANGO_SETTINGS_MODULE=fleetwatch.settings
# Logs: text a person can read when the output is a terminal, JSON otherwise (a file, a log
# shipper), unless FLEETWATCH_LOG_FORMAT says which. The image and the Kubernetes manifests do
# not come through here: they log JSON (the settings' default; deploy/kubernetes/base).
if [ -z "${FLEETWATCH_LOG_FORMAT:-}" ]; then
  if [ -t 1 ]; then FLEETWATCH_LOG_FORMAT=plain; else FLEETWATCH_LOG_FORMAT=json; fi
fi
export FLEETWATCH_LOG_FORMAT

# First of all, before any migration or seed: a second `make run` that cannot listen must
# leave the first one exactly as it is. Bound as gunicorn binds (SO_REUSEADDR).
$BIN/python - "$HOST" "$PORT" <<'EOF'
import socket
import sys

host, port = sys.argv[1], int(sys.argv[2])
try:
    for family, kind, proto, _, address in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
except OSError as exc:
    sys.exit(f"make run: cannot listen on {host}:{port} ({exc.strerror or exc}); nothing was "
             f"started or changed. Is FleetWatch already running there? Stop it, or choose "
             f"another port: make run PORT={port + 1}")
EOF

# One stack per data folder: its SQLite database and broker have one worker, which is what
# lets steps-resume below take every step lease for a dead worker's. The lock is on a file
# descriptor every process started here inherits, so it is held until the last one is gone.
# "embedded": SQLite and the filesystem broker, nothing shared with another machine.
# data_dir_prepare: the data folder, its broker folder and the saved secret key, made before any
# process reads the settings (importing them writes nothing; fleetwatch/datadir.py).
settings=$($BIN/python -c 'from fleetwatch.datadir import data_dir_prepare; data_dir_prepare()
import django; django.setup(); from django.conf import settings as s
print(int(s.DATABASES["default"]["ENGINE"].endswith("sqlite3") and s.CELERY_BROKER_URL.startswith("filesystem://")))
print(s.DATA_DIR)')
embedded=${settings%%$'\n'*}
data_dir=${settings#*$'\n'}
exec 9>>"$data_dir/run.lock"
if ! flock -n 9; then
  echo "make run: FleetWatch is already running on $data_dir (its processes hold" \
       "$data_dir/run.lock); stop it first, or use another FLEETWATCH_DATA_DIR" >&2
  exit 1
fi

pids=()   # the three children, each the leader of its own session and process group
step=     # the set-up command running now
kill_groups() { for pid in "${pids[@]}"; do kill "-$1" -- "-$pid" 2>/dev/null || true; done; }
any_alive() { for pid in "${pids[@]}"; do kill -0 -- "-$pid" 2>/dev/null && return 0; done; return 1; }
stop() {
  local status=$?
  trap - EXIT
  trap 'kill_groups KILL; exit 130' INT TERM HUP  # impatient: a second Ctrl-C kills at once
  [ -n "$step" ] && kill -TERM "$step" 2>/dev/null
  [ -n "${seed_out:-}" ] && rm -f "$seed_out"
  if [ ${#pids[@]} -gt 0 ]; then
    echo "FleetWatch: stopping web, worker and beat" >&2
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    local deadline=$((SECONDS + STOP_SECONDS))
    while any_alive && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    if any_alive; then
      echo "FleetWatch: still running after ${STOP_SECONDS}s, killed (SIGKILL)" >&2
      kill_groups KILL
    fi
  fi
  wait 2>/dev/null || true
  exit "$status"
}
trap stop INT TERM HUP EXIT
# Set-up commands run in the background and are waited for, so a signal is acted on at once
# (bash runs a trap only after a foreground command ends).
run_step() { local status=0; "$@" & step=$!; wait "$step" || status=$?; step=; return "$status"; }

run_step $BIN/python manage.py migrate --noinput -v0
# The login is kept across starts (its password saved in the data folder, the owner's alone);
# FLEETWATCH_DEMO_PASSWORD sets one, FLEETWATCH_DEMO_ROTATE=1 makes a new one. Its line is kept
# for the banner printed once everything has started.
rotate=
if [ "${FLEETWATCH_DEMO_ROTATE:-0}" = 1 ]; then rotate=--rotate-password; fi
seed_out=$(mktemp "$data_dir/.seed.XXXXXX")  # 0600; removed by stop() if cut off
run_step $BIN/python manage.py fleetwatch seed --demo-user "${FLEETWATCH_DEMO_USER:-demo}" \
  ${FLEETWATCH_DEMO_PASSWORD:+--password "$FLEETWATCH_DEMO_PASSWORD"} $rotate >"$seed_out"
login=$(sed -n 's/^login: //p' "$seed_out")
cat "$seed_out"
rm -f "$seed_out"
seed_out=
if [ "$embedded" = 1 ]; then
  # A step the last stop cut off resumes now rather than after its lease.
  run_step $BIN/python manage.py fleetwatch steps-resume
fi

start() { setsid "$@" </dev/null & pids+=($!); }
started_at=$(date +%s)
start $BIN/celery -A fleetwatch worker -Q collect,diagnose,remediate,default \
  --concurrency "${FLEETWATCH_WORKER_CONCURRENCY:-2}" --loglevel INFO
start $BIN/celery -A fleetwatch beat --loglevel INFO -s "$data_dir/celerybeat-schedule"
# deploy/gunicorn.conf.py: FleetWatch's log format, Prometheus multiprocess counting for /metrics.
start $BIN/gunicorn -c deploy/gunicorn.conf.py --bind "$HOST:$PORT" --workers "${WEB_CONCURRENCY:-2}"

# The banner comes once everything has started, below the start-up logs that would bury it:
# the web answers /healthz (database and broker reachable) and the worker has run a collection
# (beat sends one every FLEETWATCH_COLLECT_INTERVAL). After FLEETWATCH_READY_SECONDS (60) it
# comes anyway and says what is missing. One of the three ending stops the wait (and the rest).
url_host=$HOST
case $HOST in 0.0.0.0|"") url_host=127.0.0.1 ;; ::|"[::]") url_host="[::1]" ;; *:*) url_host="[$HOST]" ;; esac
url="http://$url_host:$PORT/"
ready=0
# (The check is passed with -c: a command run in the background reads /dev/null, not a heredoc.)
ready_check=$(cat <<'EOF'
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import django

url, since, limit, pids = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
django.setup()
from collectors.models import SourceHealth  # noqa: E402

started = datetime.fromtimestamp(since, UTC)


def alive(pid: str) -> bool:
    try:  # a child that has ended but not been reaped yet is a zombie ("Z")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def web_up() -> bool:
    try:
        with urllib.request.urlopen(url + "healthz", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


deadline = time.monotonic() + limit
web = collected = False
while time.monotonic() < deadline:
    if not all(alive(pid) for pid in pids):
        sys.exit(3)
    web = web or web_up()
    collected = collected or SourceHealth.objects.filter(last_run_at__gte=started).exists()
    if web and collected:
        sys.exit(0)
    time.sleep(0.5)
sys.exit(1 if not web else 2)
EOF
)
run_step $BIN/python -c "$ready_check" "$url" "$started_at" "${FLEETWATCH_READY_SECONDS:-60}" \
  "${pids[@]}" || ready=$?

if [ "$ready" != 3 ]; then
  echo
  case $ready in
    0) echo "FleetWatch is running on $url" ;;
    1) echo "FleetWatch started, but $url does not answer yet (see the logs above)" ;;
    *) echo "FleetWatch is up on $url, but no collection has run yet (see the worker's logs above)" ;;
  esac
  # "demo / PASSWORD" from the seed; "demo (password unchanged, ...)" when it was changed by hand.
  [ -n "$login" ] && echo "Log in as $login"
  if [ "${FLEETWATCH_FLEET:-sim}" = sim ]; then
    echo "Inject a fault:  $BIN/python manage.py fleetwatch inject xid --node gpu-003 --gpu 5 --code 79"
  else
    echo "Real sources: FLEETWATCH_FLEET=$FLEETWATCH_FLEET (see the README's \"Pointing FleetWatch at a cluster\")"
  fi
  echo "Ctrl-C stops it."
  echo
fi
# Whichever of the three ends first (a crash, or a signal sent to it alone) stops the others.
# Checked every second rather than with one `wait -n`: a signal that lands just before bash
# blocks in wait is acted on only once a child ends (seen on a loaded machine: a Ctrl-C right
# after the banner did nothing), so no wait here lasts longer than a second.
all_alive() { for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || return 1; done; }
while all_alive; do sleep 1 & wait "$!" || true; done
wait -n "${pids[@]}"  # the ended child's status (at once: it has ended) is the script's
