#!/usr/bin/env bash
# Start FleetWatch on its embedded default: SQLite and a filesystem Celery broker in
# FLEETWATCH_DATA_DIR (./data), the simulated fleet (or, with FLEETWATCH_FLEET=real, the
# sources the environment names), the web UI on $HOST:$PORT.
# Runs web (gunicorn), one Celery worker for all queues and Celery beat; Ctrl-C stops all three.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN=$VENV/bin
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
export DJANGO_SETTINGS_MODULE=fleetwatch.settings

$BIN/python manage.py migrate --noinput -v0
$BIN/python manage.py fleetwatch seed --demo-user "${FLEETWATCH_DEMO_USER:-demo}" \
  ${FLEETWATCH_DEMO_PASSWORD:+--password "$FLEETWATCH_DEMO_PASSWORD"}

pids=()
stop() { trap - INT TERM EXIT; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop INT TERM EXIT

data_dir=$($BIN/python -c 'from django.conf import settings; import django; django.setup(); print(settings.DATA_DIR)')
$BIN/celery -A fleetwatch worker -Q collect,diagnose,remediate,default \
  --concurrency "${FLEETWATCH_WORKER_CONCURRENCY:-2}" --loglevel INFO &
pids+=($!)
$BIN/celery -A fleetwatch beat --loglevel INFO -s "$data_dir/celerybeat-schedule" &
pids+=($!)
# deploy/gunicorn.conf.py: JSON logs, Prometheus multiprocess counting for /metrics.
$BIN/gunicorn -c deploy/gunicorn.conf.py --bind "$HOST:$PORT" --workers "${WEB_CONCURRENCY:-2}" &
pids+=($!)

echo
echo "FleetWatch is starting on http://$HOST:$PORT/  (log in with the demo login above)"
if [ "${FLEETWATCH_FLEET:-sim}" = sim ]; then
  echo "Inject a fault:  $BIN/python manage.py fleetwatch inject xid --node gpu-003 --gpu 5 --code 79"
else
  echo "Real sources: FLEETWATCH_FLEET=$FLEETWATCH_FLEET (see the README's \"Pointing FleetWatch at a cluster\")"
fi
echo
wait -n "${pids[@]}"
