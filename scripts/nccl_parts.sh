#!/usr/bin/env bash
# The pinned NCCL (scripts/install_deps.sh's nccl_version) for the GPU machines, which hold only
# PyTorch's 2.28.9 and no network: the nvidia-nccl-cu13 wheel's headers and libnccl.so.2 (344 MB,
# every GPU architecture) as one .tar.xz split into parts that each fit one device call beside the
# working tree, in third_party/nccl/partN/ (git-ignored). Run here (pip and network); on a GPU
# machine kept warm, carry third_party/nccl/part1 .. partN one a call to scripts/nccl_stash.sh,
# which assembles them after the last.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^nccl_version=//p' scripts/install_deps.sh)
out=third_party/nccl
part_mib=${PART_MIB:-56}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" "nvidia-nccl-cu13==$version"
python3 -m zipfile -e "$tmp"/nvidia_nccl_cu13-*.whl "$tmp/w"
mkdir -p "$tmp/nccl-$version"
cp -r "$tmp/w/nvidia/nccl/include" "$tmp/nccl-$version/include"
mkdir -p "$tmp/nccl-$version/lib"
cp "$tmp/w/nvidia/nccl/lib/libnccl.so.2" "$tmp/nccl-$version/lib/"
tar -C "$tmp" -cf - "nccl-$version" | xz -T0 -6 >"$tmp/nccl.tar.xz"
rm -rf "$out"
(cd "$tmp" && split -a 1 --numeric-suffixes=1 -b "${part_mib}M" nccl.tar.xz nccl.tar.xz.part)
n=0
for p in "$tmp"/nccl.tar.xz.part*; do
  n=$((n + 1))
  mkdir -p "$out/part$n"
  mv "$p" "$out/part$n/"
done
sha256sum "$tmp/nccl.tar.xz" | cut -d' ' -f1 >"$out/SHA256"
for i in $(seq 1 "$n"); do cp "$out/SHA256" "$out/part$i/"; echo "$n" >"$out/part$i/PARTS"; done
echo "nccl_parts: NCCL $version in $n parts under $out ($(du -sh "$out" | cut -f1)); carry" \
  "$out/part1 .. part$n, one a call, to scripts/nccl_stash.sh"
