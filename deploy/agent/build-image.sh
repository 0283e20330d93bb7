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

# --- tools: Debian's, installed only where missing ------------------------------------------
need=()
for tool in mmdebstrap podman runc rsync git; do
  command -v "$tool" >/dev/null || need+=("$tool")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "build-image.sh: missing ${need[*]} (run as root, or install them)" >&2; exit 1
  fi
  echo "installing ${need[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}"
fi

# This machine's kind (hybrid cgroup v1, no CAP_SYS_RESOURCE) needs runc, the cgroupfs manager
# and ulimits at or under the hard limits (RECIPE.md, errors 3 and 4); they do no harm elsewhere.
nofile=$(ulimit -Hn)
[ "$nofile" = unlimited ] && nofile=1048576
podman=(podman --runtime runc --cgroup-manager cgroupfs)
limits=(--ulimit "nofile=$nofile:$nofile" --ulimit nproc=16384:16384)

work=$(mktemp -d "${TMPDIR:-/tmp}/fleetwatch-agent-image.XXXXXX")
trap 'rm -rf "$work"' EXIT

# --- the base: a Debian 12 rootfs from the host's own apt sources, imported once -------------
if [ "${REBUILD_BASE:-0}" = 1 ] || ! "${podman[@]}" image exists "$base"; then
  sources=/etc/apt/sources.list.d/debian.sources
  [ -f "$sources" ] || sources=/etc/apt/sources.list
  # merged-usr hook: without it minbase pulls usrmerge and perl (RECIPE.md, error 2).
  mmdebstrap --variant=minbase \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --include=python3,python3-venv,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    bookworm "$work/base.tar" "$sources"
  "${podman[@]}" import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' \
    "$work/base.tar" "$base"
  rm -f "$work/base.tar"
fi

# --- the context: the checkout's collectors/ and requirements.txt as git sees them -----------
mkdir -p "$work/ctx/src"
git -C "$src" ls-files -z --cached --others --exclude-standard -- collectors requirements.txt \
  | rsync -a --from0 --files-from=- --ignore-missing-args "$src/" "$work/ctx/src/"
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

# PyPI is reached through the host's CA bundle, mounted for the build only (RECIPE.md, error 6):
# the image ships Debian's own bundle.
ca=/etc/ssl/certs/ca-certificates.crt
"${podman[@]}" build --network host "${limits[@]}" \
  -v "$ca:$ca:ro" --build-arg PIP_CERT="$ca" \
  --build-arg BASE="$base" --build-arg VERSION="$version" --build-arg REVISION="$revision" \
  -t "$image:$version" -t "$image:latest" -f "$work/ctx/Containerfile" "$work/ctx"

# The image must say the version it is tagged with.
said=$("${podman[@]}" run --rm --network none "${limits[@]}" "$image:$version" --version)
case "$said" in
  *"$version"*) ;;
  *) echo "build-image.sh: $image:$version says '$said' to --version" >&2; exit 1 ;;
esac
size=$("${podman[@]}" image inspect --format '{{.Size}}' "$image:$version")
echo "built $image:$version (and :latest), $((size / 1000000)) MB; --version: $said"
