# Shared by the image build scripts (deploy/image/build.sh, deploy/agent/build-image.sh):
# Debian's tools, podman as this kind of machine needs it, the Debian 12 base image made once,
# and a build context from the checkout as git sees it. The recipe: shared/image/RECIPE.md.
# Source it (bash, set -euo pipefail); it defines functions and the arrays PODMAN and LIMITS.

# Debian's mmdebstrap, podman, runc, rsync and git, installed only where missing (root).
fw_tools_ensure() {
  local need=() tool
  for tool in mmdebstrap podman runc rsync git; do
    command -v "$tool" >/dev/null || need+=("$tool")
  done
  [ ${#need[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "$(basename "$0"): missing ${need[*]} (run as root, or install them)" >&2; exit 1
  fi
  echo "installing ${need[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}"
}

# This machine's kind (hybrid cgroup v1, no CAP_SYS_RESOURCE) needs runc, the cgroupfs manager
# and ulimits at or under the hard limits (RECIPE.md, errors 3 and 4); they do no harm elsewhere.
_fw_nofile=$(ulimit -Hn)
[ "$_fw_nofile" = unlimited ] && _fw_nofile=1048576
PODMAN=(podman --runtime runc --cgroup-manager cgroupfs)
LIMITS=(--ulimit "nofile=$_fw_nofile:$_fw_nofile" --ulimit nproc=16384:16384)

# fw_base_ensure IMAGE WORKDIR: a Debian 12 rootfs from the host's own apt sources (python3,
# its venv module and the CA bundle), imported as IMAGE once; REBUILD_BASE=1 makes it again
# (for Debian's security updates).
fw_base_ensure() {
  local base=$1 work=$2 sources
  if [ "${REBUILD_BASE:-0}" != 1 ] && "${PODMAN[@]}" image exists "$base"; then
    return 0
  fi
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
  "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' \
    "$work/base.tar" "$base"
  rm -f "$work/base.tar"
}

# fw_context SRC DEST [PATHSPEC...]: the checkout's files as git sees them (tracked, and
# untracked ones not ignored: no .git, no venv, no data folder), limited to PATHSPECs, copied
# into DEST.
fw_context() {
  local src=$1 dest=$2
  shift 2
  mkdir -p "$dest"
  git -C "$src" ls-files -z --cached --others --exclude-standard -- "$@" \
    | rsync -a --from0 --files-from=- --ignore-missing-args "$src/" "$dest/"
}

# fw_build CONTEXT CONTAINERFILE [podman build options...]: podman build on the host network,
# PyPI reached through the host's CA bundle, mounted for the build only (RECIPE.md, error 6):
# the image ships Debian's own bundle.
fw_build() {
  local ctx=$1 file=$2 ca=/etc/ssl/certs/ca-certificates.crt
  shift 2
  "${PODMAN[@]}" build --network host "${LIMITS[@]}" \
    -v "$ca:$ca:ro" --build-arg PIP_CERT="$ca" "$@" -f "$file" "$ctx"
}
