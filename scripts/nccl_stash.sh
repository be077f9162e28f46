#!/usr/bin/env bash
# On a GPU machine: keeps the parts of scripts/nccl_parts.sh carried in this call (any of
# third_party/nccl/partN present) in $NCCL_STASH (default /tmp/nccl_stash, outside the tree, so
# they outlive the call while the machine stays warm); once every part is there, checks the
# archive's sha256 and unpacks it to $NCCL_STASH/nccl-<version>. Prints the NCCL_ROOT to use and
# exits 0 when the library is ready, 3 while parts are missing. Then:
#   NCCL_ROOT=$NCCL_STASH/nccl-<version>  (CMake and scripts/nccl_env.sh look there first)
#   LD_PRELOAD=$NCCL_ROOT/lib/libnccl.so.2 (PyTorch's NCCL process groups load the same library)
set -uo pipefail
cd "$(dirname "$0")/.."
stash=${NCCL_STASH:-/tmp/nccl_stash}
version=$(sed -n 's/^nccl_version=//p' scripts/install_deps.sh)
root=$stash/nccl-$version
mkdir -p "$stash"
if [ -f "$root/lib/libnccl.so.2" ]; then
  echo "nccl_stash: ready: NCCL_ROOT=$root"
  exit 0
fi
for d in third_party/nccl/part*; do
  [ -d "$d" ] || continue
  cp -f "$d"/nccl.tar.xz.part* "$d/SHA256" "$d/PARTS" "$stash"/ && echo "nccl_stash: kept $(basename "$d")"
done
[ -f "$stash/PARTS" ] || { echo "nccl_stash: no part carried yet"; exit 3; }
want=$(cat "$stash/PARTS")
have=$(ls "$stash"/nccl.tar.xz.part* 2>/dev/null | wc -l)
if [ "$have" -lt "$want" ]; then
  echo "nccl_stash: $have of $want parts"
  exit 3
fi
t0=$SECONDS
if [ "$(cat "$stash"/nccl.tar.xz.part* | sha256sum | cut -d' ' -f1)" != "$(cat "$stash/SHA256")" ]; then
  echo "nccl_stash: the parts do not add up to the archive (sha256); carry them again"
  rm -f "$stash"/nccl.tar.xz.part*
  exit 1
fi
cat "$stash"/nccl.tar.xz.part* | xz -d | tar -C "$stash" -xf - || exit 1
rm -f "$stash"/nccl.tar.xz.part*
echo "nccl_stash: ready in $((SECONDS - t0)) s: NCCL_ROOT=$root"
