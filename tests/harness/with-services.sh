#!/usr/bin/env bash
# Run a command with PostgreSQL and Redis available, as the test suite needs them.
# Uses the ones answering on 127.0.0.1:5432 / :6379 when there are; otherwise starts private
# instances (temporary data dir, a free loopback port) and stops them afterwards.
# Exports DATABASE_URL, CELERY_BROKER_URL and SECRET_KEY for the command.
# FLEETWATCH_PRIVATE_SERVICES=1 skips the shared ones (to test this script's private path).
set -euo pipefail
tmp=$(mktemp -d /tmp/fleetwatch-services.XXXXXX)
chmod 755 "$tmp"
cleanup() {
  [ -n "${PG_DATA:-}" ] && run_as_pg pg_ctl -D "$PG_DATA" -m fast stop >/dev/null 2>&1 || true
  [ -f "$tmp/redis.pid" ] && kill "$(cat "$tmp/redis.pid")" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pg_bin() {
  local found
  found=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
  if [ -n "$found" ]; then echo "$found"; else dirname "$(command -v initdb)"; fi
}
run_as_pg() {
  # initdb and postgres refuse to run as root.
  local cmd=$1; shift
  if [ "$(id -u)" = 0 ]; then
    local user=postgres; id postgres >/dev/null 2>&1 || user=nobody
    runuser -u "$user" -- "$(pg_bin)/$cmd" "$@"
  else
    "$(pg_bin)/$cmd" "$@"
  fi
}

if [ -z "${DATABASE_URL:-}" ]; then
  if [ -z "${FLEETWATCH_PRIVATE_SERVICES:-}" ] && psql -h 127.0.0.1 -p 5432 -U postgres -d postgres -tAc 'select 1' >/dev/null 2>&1; then
    export DATABASE_URL=postgres://postgres@127.0.0.1:5432/fleetwatch
    echo "services: using PostgreSQL on 127.0.0.1:5432"
  else
    port=$(free_port)
    PG_DATA=$tmp/pg
    mkdir -p "$PG_DATA"
    [ "$(id -u)" = 0 ] && chown "$(id -u postgres 2>/dev/null || id -u nobody)" "$PG_DATA" "$tmp"
    run_as_pg initdb -D "$PG_DATA" -U postgres --auth=trust -E UTF8 >/dev/null
    run_as_pg pg_ctl -D "$PG_DATA" -w -l "$PG_DATA/log" \
      -o "-p $port -k $tmp -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null
    export DATABASE_URL=postgres://postgres@127.0.0.1:$port/fleetwatch
    echo "services: started a private PostgreSQL on 127.0.0.1:$port"
  fi
fi

if [ -z "${CELERY_BROKER_URL:-}" ]; then
  if [ -z "${FLEETWATCH_PRIVATE_SERVICES:-}" ] && [ "$(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" = PONG ]; then
    export CELERY_BROKER_URL=redis://127.0.0.1:6379/9
    echo "services: using Redis on 127.0.0.1:6379 (db 9)"
  else
    port=$(free_port)
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
      --pidfile "$tmp/redis.pid" --dir "$tmp" --logfile "$tmp/redis.log"
    for _ in $(seq 50); do [ "$(redis-cli -p "$port" ping 2>/dev/null)" = PONG ] && break; sleep 0.1; done
    export CELERY_BROKER_URL=redis://127.0.0.1:$port/0
    echo "services: started a private Redis on 127.0.0.1:$port"
  fi
fi

export FLEETWATCH_DATA_DIR=${FLEETWATCH_DATA_DIR:-$tmp/data}
# The suite runs the simulated fleet on PostgreSQL; the settings refuse a database server
# without a named fleet (a deployment that forgot it), so the tests name theirs.
export FLEETWATCH_FLEET=${FLEETWATCH_FLEET:-sim}
# A database server means a deployment, which the settings refuse without SECRET_KEY (a key
# saved in one data folder would not be shared by every process of a real one): one key for
# this run, shared by the suite and every process it starts.
export SECRET_KEY=${SECRET_KEY:-$(python3 -c 'import secrets; print(secrets.token_urlsafe(50))')}
# The data folder and its saved secret key, made as make run makes them, before any process
# reads the settings: the suite's own process and the workers it starts share that key.
(cd "$(dirname "$0")/../.." &&
   "${VENV:-.venv}/bin/python" -c 'from fleetwatch.datadir import data_dir_prepare; data_dir_prepare()')
"$@"
