#!/usr/bin/env bash
# Build FleetWatch's server image with podman; no image registry needed (README.md beside
# this file; the recipe is shared/image/RECIPE.md).
#
#   deploy/image/build.sh            # or: make image
#
# Makes localhost/fleetwatch:<version>-g<revision> and :latest from the checkout it is run from.
# Environment:
#   FLEETWATCH_SRC  the checkout to build from (default: the git repository holding this script)
#   REBUILD_BASE=1  make the Debian base image again (for Debian's security updates); otherwise
#                   it is made once and reused (the agent's image shares it)
#   IMAGE           the image name (default localhost/fleetwatch)
#   BASE_IMAGE      the base image name (default localhost/fleetwatch-base:bookworm)
#   NO_CACHE=1      build every layer again (podman build --no-cache)
# Needs root: mmdebstrap's root mode and rootful podman.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
src=${FLEETWATCH_SRC:-$(git -C "$here" rev-parse --show-toplevel)}
src=$(cd "$src" && pwd)
image=${IMAGE:-localhost/fleetwatch}
base=${BASE_IMAGE:-localhost/fleetwatch-base:bookworm}

# shellcheck source=lib.sh
. "$here/lib.sh"  # the tools, podman's options, the base image, the context
fw_tools_ensure

work=$(mktemp -d "${TMPDIR:-/tmp}/fleetwatch-image.XXXXXX")
trap 'rm -rf "$work"' EXIT

fw_base_ensure "$base" "$work"

# --- the context: what the server runs, as git sees it (no tests, no .git, venv or data) ------
# A change to the tests or the docs then rebuilds nothing.
# deploy/checks: the acceptance checks a gate's check Job runs in this image (Kubernetes pools).
fw_context "$src" "$work/ctx/src" manage.py requirements.txt fleetwatch collectors incidents \
  templates static deploy/gunicorn.conf.py deploy/image/entrypoint.sh deploy/checks
cp "$here/Containerfile" "$work/ctx/"

revision=$(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown)
git -C "$src" diff --quiet HEAD -- manage.py requirements.txt fleetwatch collectors incidents \
  templates static deploy 2>/dev/null || revision="$revision-dirty"
# The project's version (pyproject.toml) and the commit: 0.1.0+g<12 hex digits>; the tag the
# same with "-" (a tag cannot hold "+").
project=$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  "$src/pyproject.toml" 2>/dev/null || echo 0)
version=$project+g${revision:0:12}
[ "$revision" = unknown ] && version=$project+unknown

# docker format: OCI image configs have no HEALTHCHECK (podman drops it with a warning).
fw_build "$work/ctx" "$work/ctx/Containerfile" --format docker ${NO_CACHE:+--no-cache} \
  --build-arg BASE="$base" --label org.opencontainers.image.version="$version" \
  --label org.opencontainers.image.revision="$revision" \
  -t "$image:${version/+/-}" -t "$image:latest"

# The image must be able to load its settings and find its collected static files.
"${PODMAN[@]}" run --rm --network none "${LIMITS[@]}" --read-only -v /data -e SECRET_KEY=build-check \
  "$image:latest" manage check -v0 >/dev/null
size=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$image:latest")
echo "built $image:${version/+/-} (and :latest), $((size / 1000000)) MB"
