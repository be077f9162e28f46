#!/usr/bin/env bash
# Downloads the peers of bench/peers_bench.py as wheels for the GPU machine (Python 3.12, x86-64,
# PyTorch 2.11 + CUDA 13 there; no network there) into third_party/wheels/<group>/ (git-ignored),
# in groups that each fit one device call beside the working tree (64 MiB a call in all; the
# tracked tree is about 5 MiB, so a group is at most 56 MiB). Run it in the root of the checkout
# the device calls are made from. Needs pip and network here; installs nothing.
#
#   base   (carry third_party/wheels/base, in the call of peers_round.sh's main stage, with
#          third_party/cutlass): torchtitan 0.3.0 with spmd_types, tyro, docstring-parser and
#          typeguard; megatron-core 0.19.2; torchao 0.18.0
#   sonic  (third_party/wheels/sonic, the sonic stage): sonic-moe 0.1.2.post1,
#          nvidia-cutlass-dsl 4.4.2 (its 71 MiB libs-base wheel repacked as .tar.xz, 50 MiB),
#          quack-kernels 0.4.1, apache-tvm-ffi, torch-c-dlpack-ext
#   te1..5 (third_party/wheels/teN, the te-stash stage for N = 1..4 and the te stage for 5, one
#          call each on a machine kept warm; only if device time allows): transformer-engine
#          2.20.2 (the 264 MiB transformer_engine_cu13 wheel, the torch extension's sdist,
#          built there), cudnn-frontend headers, pydantic, nvdlfw-inspect: one tar in 5 parts
#
# WHEEL_GROUPS="base sonic" (default "base sonic te") picks groups. Each group's files, sizes and
# sha256 are written to third_party/wheels/MANIFEST.txt; a group over 56 MiB fails the script.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=third_party/wheels
mkdir -p "$W"
groups=${WHEEL_GROUPS:-base sonic te}
PY=${PYTHON:-python3}
limit_mib=56
target=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)

get() {  # get DIR REQUIREMENT...: binary wheels for the GPU machine's Python into DIR
  local dir=$1
  shift
  for req in "$@"; do
    "$PY" -m pip download -q "${target[@]}" -d "$dir" "$req"
  done
}

mib() { du -cb "$@" | tail -1 | awk '{printf "%.1f", $1 / 1048576}'; }

check_group() {  # check_group NAME DIR: its size within the limit, into the manifest
  local name=$1 dir=$2 size
  size=$(mib "$dir")
  {
    echo "== $name ($dir): $size MiB"
    (cd "$dir" && for f in *; do printf '%12d  %s  %s\n' "$(stat -c %s "$f")" \
      "$(sha256sum "$f" | cut -c1-16)" "$f"; done)
  } >>"$W/MANIFEST.txt"
  echo "$name: $size MiB in $dir"
  if awk -v s="$size" -v l="$limit_mib" 'BEGIN { exit !(s > l) }'; then
    echo "fetch_wheels: group $name is $size MiB, over the $limit_mib MiB a call can carry" >&2
    exit 1
  fi
}

: >"$W/MANIFEST.txt"
for g in $groups; do
  case $g in
    base)
      rm -rf "$W/base" && mkdir -p "$W/base"
      get "$W/base" torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 \
        typeguard==4.6.1 megatron-core==0.19.2 torchao==0.18.0
      check_group base "$W/base"
      ;;
    sonic)
      rm -rf "$W/sonic" && mkdir -p "$W/sonic"
      # sonic-moe pins nvidia-cutlass-dsl 4.4.2 (and torch <= 2.9.1, ignored: --no-deps); the
      # newest quack-kernels that accepts that DSL is 0.4.1 (0.5 pins 4.6.0.dev0).
      get "$W/sonic" sonic-moe==0.1.2.post1 nvidia-cutlass-dsl==4.4.2 quack-kernels==0.4.1 \
        apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
      # The CuTe DSL runtime wheel is 71 MiB: more than a call carries. Unpacked and packed again
      # with xz it is 50 MiB; peers_round.sh unpacks it into the site folder as pip would (a
      # wheel of plain files, no scripts, one .pth), the other wheels through pip.
      tmp=$(mktemp -d)
      get "$tmp" nvidia-cutlass-dsl-libs-base==4.4.2
      mkdir "$tmp/x"
      (cd "$tmp/x" && unzip -q ../nvidia_cutlass_dsl_libs_base-*.whl)
      name=$(basename "$tmp"/nvidia_cutlass_dsl_libs_base-*.whl .whl)
      tar -C "$tmp/x" -cf - . | xz -9 -T"$(nproc)" >"$W/sonic/$name.tar.xz"
      rm -rf "$tmp"
      check_group sonic "$W/sonic"
      ;;
    te)
      tmp=$(mktemp -d)
      get "$tmp/te" transformer-engine==2.20.2 transformer-engine-cu13==2.20.2 \
        nvidia-cudnn-frontend==1.32.0 nvdlfw-inspect==0.2.2 pydantic==2.14.4 \
        pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      # TE's torch extension exists only as an sdist that compiles against the torch there. pip
      # prepares an sdist's metadata before saving it, which runs its setup.py (it imports torch
      # and wheel): in a throwaway venv that sees this machine's torch.
      "$PY" -m venv --system-site-packages "$tmp/venv"
      "$tmp/venv/bin/python" -m pip install -q wheel
      "$tmp/venv/bin/python" -m pip download -q --no-deps --no-build-isolation \
        --no-binary=:all: -d "$tmp/te" transformer-engine-torch==2.20.2
      tar -C "$tmp" -cf "$tmp/te.tar" te
      rm -rf "$W"/te[0-9]*
      size=$(stat -c %s "$tmp/te.tar")
      part=$(((size + 4) / 5 + 1))
      (cd "$tmp" && split -a 1 --numeric-suffixes=1 -b "$part" te.tar te.tar.part)
      for i in 1 2 3 4 5; do
        mkdir -p "$W/te$i" && mv "$tmp/te.tar.part$i" "$W/te$i/"
        check_group "te$i" "$W/te$i"
      done
      (cd "$tmp/te" && ls -l) >>"$W/MANIFEST.txt"
      rm -rf "$tmp"
      ;;
    *) echo "fetch_wheels: unknown group $g (allowed: base sonic te)" >&2; exit 2 ;;
  esac
done
echo "sizes and sha256 in $W/MANIFEST.txt"
