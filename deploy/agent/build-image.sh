#!/usr/bin/env bash
# Build the node agent's OCI image with podman; no image registry needed (README.md beside
# this file; the recipe is shared/image/RECIPE.md).
#
#   deploy/agent/build-image.sh            # or: make agent-image
#
# Makes localhost/fleetwatch-agent:<version> and :latest from the agent package in the checkout
# it is run from (collectors/agent/pyproject.toml, built into a wheel inside the image build).
# Environment:
#   FLEETWATCH_AGENT_SRC  the checkout to build from (default: the git repository holding this
#                         script)
#   REBUILD_BASE=1        make the Debian base image again (for Debian's security updates);
#                         otherwise it is made once and reused
#   IMAGE                 the image name (default localhost/fleetwatch-agent)
#   BASE_IMAGE            the base image name (default localhost/fleetwatch-base:bookworm, the
#                         same base as FleetWatch's own image)
# Needs root: mmdebstrap's root mode and rootful podman. Exit status 3: the checkout has no
# agent package.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
src=${FLEETWATCH_AGENT_SRC:-$(git -C "$here" rev-parse --show-toplevel)}
src=$(cd "$src" && pwd)
image=${IMAGE:-localhost/fleetwatch-agent}
base=${BASE_IMAGE:-localhost/fleetwatch-base:bookworm}

if [ ! -f "$src/collectors/agent/pyproject.toml" ]; then
  echo "build-image.sh: $src/collectors/agent/pyproject.toml is missing: this checkout has no" \
       "installable agent package (fleetwatch-agent) to build an image from" >&2
  exit 3
fi

# shellcheck source=../image/lib.sh
. "$here/../image/lib.sh"  # the tools, podman's options, the base image, the context
fw_tools_ensure

work=$(mktemp -d "${TMPDIR:-/tmp}/fleetwatch-agent-image.XXXXXX")
trap 'rm -rf "$work"' EXIT

fw_base_ensure "$base" "$work"

# --- the context: the checkout's collectors/ and requirements.txt as git sees them -----------
fw_context "$src" "$work/ctx/src" collectors requirements.txt
cp "$here/Containerfile" "$work/ctx/"

# The version the package declares: a static project.version, or hatch's version file.
version=$(python3 - "$src/collectors/agent" <<'EOF'
import pathlib, re, sys, tomllib
root = pathlib.Path(sys.argv[1])
meta = tomllib.loads((root / "pyproject.toml").read_text())
version = meta.get("project", {}).get("version")
path = meta.get("tool", {}).get("hatch", {}).get("version", {}).get("path")
if not version and path:
    found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", (root / path).read_text(), re.M)
    version = found and found.group(1)
print(version or "0+unknown")
EOF
)
revision=$(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown)
git -C "$src" diff --quiet HEAD -- collectors 2>/dev/null || revision="$revision-dirty"

fw_build "$work/ctx" "$work/ctx/Containerfile" \
  --build-arg BASE="$base" --label org.opencontainers.image.version="$version" \
  --label org.opencontainers.image.revision="$revision" \
  -t "$image:$version" -t "$image:latest"

# The image must say the version it is tagged with.
said=$("${PODMAN[@]}" run --rm --network none "${LIMITS[@]}" "$image:$version" --version)
case "$said" in
  *"$version"*) ;;
  *) echo "build-image.sh: $image:$version says '$said' to --version" >&2; exit 1 ;;
esac
size=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$image:$version")
echo "built $image:$version (and :latest), $((size / 1000000)) MB; --version: $said"
