#!/usr/bin/env bash
# Start FleetWatch on its embedded default: SQLite and a filesystem Celery broker in
# FLEETWATCH_DATA_DIR (./data), the simulated fleet (or, with FLEETWATCH_FLEET=real, the
# sources the environment names), the web UI on $HOST:$PORT.
# Runs web (gunicorn), one Celery worker for all queues and Celery beat.
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
run_step() { "$@" & step=$!; wait "$step"; step=; }

run_step $BIN/python manage.py migrate --noinput -v0
run_step $BIN/python manage.py fleetwatch seed --demo-user "${FLEETWATCH_DEMO_USER:-demo}" \
  ${FLEETWATCH_DEMO_PASSWORD:+--password "$FLEETWATCH_DEMO_PASSWORD"}
if [ "$embedded" = 1 ]; then
  # A step the last stop cut off resumes now rather than after its lease.
  run_step $BIN/python manage.py fleetwatch steps-resume
fi

start() { setsid "$@" </dev/null & pids+=($!); }
start $BIN/celery -A fleetwatch worker -Q collect,diagnose,remediate,default \
  --concurrency "${FLEETWATCH_WORKER_CONCURRENCY:-2}" --loglevel INFO
start $BIN/celery -A fleetwatch beat --loglevel INFO -s "$data_dir/celerybeat-schedule"
# deploy/gunicorn.conf.py: JSON logs, Prometheus multiprocess counting for /metrics.
start $BIN/gunicorn -c deploy/gunicorn.conf.py --bind "$HOST:$PORT" --workers "${WEB_CONCURRENCY:-2}"

echo
echo "FleetWatch is starting on http://$HOST:$PORT/  (log in with the demo login above; Ctrl-C stops it)"
if [ "${FLEETWATCH_FLEET:-sim}" = sim ]; then
  echo "Inject a fault:  $BIN/python manage.py fleetwatch inject xid --node gpu-003 --gpu 5 --code 79"
else
  echo "Real sources: FLEETWATCH_FLEET=$FLEETWATCH_FLEET (see the README's \"Pointing FleetWatch at a cluster\")"
fi
echo
# Whichever of the three ends first (a crash, or a signal sent to it alone) stops the others.
wait -n "${pids[@]}"
