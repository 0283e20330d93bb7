#!/bin/sh
# The server image's entry point (deploy/image/README.md):
#
#   web                 gunicorn with deploy/gunicorn.conf.py on $HOST:$PORT (0.0.0.0:8000);
#                       FLEETWATCH_MIGRATE=1 runs `manage.py migrate` first (off by default:
#                       migrations run once, as a Job, not in every web replica)
#   worker [QUEUES] [celery worker options...]
#                       a Celery worker for QUEUES (default collect,diagnose,remediate,default)
#   beat [celery beat options...]
#                       Celery beat (one per deployment), its schedule file in /data
#   manage ARGS...      python manage.py ARGS (migrate, createsuperuser, fleetwatch ...)
#   healthcheck         the image's HEALTHCHECK: GET /healthz on this container's web
#   anything else       run as given (e.g. `python -c ...`)
set -eu
cd /app
role=${1:-web}
[ $# -gt 0 ] && shift

case "$role" in
  web)
    case "${FLEETWATCH_MIGRATE:-0}" in
      1|true|yes|on) python manage.py migrate --noinput ;;
    esac
    # The role, for healthcheck (which runs as a separate process, in this container).
    echo web > /tmp/fleetwatch-role 2>/dev/null || true
    exec gunicorn -c /app/deploy/gunicorn.conf.py "$@"
    ;;
  worker)
    queues=collect,diagnose,remediate,default
    case "${1:-}" in ''|-*) ;; *) queues=$1; shift ;; esac
    echo worker > /tmp/fleetwatch-role 2>/dev/null || true
    exec celery -A fleetwatch worker -Q "$queues" --loglevel "${LOG_LEVEL:-INFO}" "$@"
    ;;
  beat)
    echo beat > /tmp/fleetwatch-role 2>/dev/null || true
    # The schedule file is the settings' CELERY_BEAT_SCHEDULE_FILENAME, in /data.
    exec celery -A fleetwatch beat --loglevel "${LOG_LEVEL:-INFO}" "$@"
    ;;
  manage)
    exec python manage.py "$@"
    ;;
  healthcheck)
    role=$(cat /tmp/fleetwatch-role 2>/dev/null || echo web)
    if [ "$role" != web ]; then
      echo "not web ($role): nothing served to check"; exit 0
    fi
    exec python - <<'PY'
import os, sys, urllib.request
host = os.environ.get("HOST") or "127.0.0.1"
host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
bind = os.environ.get("GUNICORN_BIND") or f"{host}:{os.environ.get('PORT') or '8000'}"
bind = bind.replace("0.0.0.0:", "127.0.0.1:")
try:
    with urllib.request.urlopen(f"http://{bind}/healthz", timeout=4) as answer:
        print(answer.status, answer.read(200).decode(errors="replace"))
except Exception as exc:  # 503 (degraded) and refused connections alike: unhealthy
    sys.exit(f"healthz: {exc}")
PY
    ;;
  *)
    exec "$role" "$@"
    ;;
esac
