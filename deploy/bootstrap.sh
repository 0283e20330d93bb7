#!/usr/bin/env bash
# Install the Debian packages FleetWatch needs, only where they are missing.
# Usage: deploy/bootstrap.sh run|test
set -euo pipefail
need=()
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ "${1:-run}" = test ]; then
  command -v redis-server >/dev/null || need+=(redis-server)
  command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
  # The real sources the integration tests start: a Slurm cluster, Prometheus.
  command -v slurmctld >/dev/null || need+=(slurm-wlm)
  command -v munged >/dev/null || need+=(munge)
  command -v prometheus >/dev/null || need+=(prometheus)
  command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
  # The browser tests drive Debian's Chromium; the Kubernetes test server makes its TLS
  # certificate with openssl; kubectl is on the machine (no Kubernetes package is installed).
  command -v chromium >/dev/null || need+=(chromium)
  # Building Slurm 25.11 from source for the tests (tests/harness/slurm_build.py): slurmrestd
  # needs json-c and http-parser, JWT needs libjwt.
  for pkg in build-essential pkg-config libmunge-dev libjwt-dev libjson-c-dev libhttp-parser-dev \
             libyaml-dev libpam0g-dev liblz4-dev libhwloc-dev zlib1g-dev; do
    dpkg-query -W -f '${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed || need+=("$pkg")
  done
  command -v openssl >/dev/null || need+=(openssl)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing Debian packages: ${need[*]} (run as root, or install them)" >&2; exit 1
  fi
  echo "installing ${need[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi
