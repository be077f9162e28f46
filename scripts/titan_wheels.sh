#!/usr/bin/env bash
# Gathers, into third_party/titan_wheels/ (git-ignored), the wheels that bench/titan_round.sh
# installs on a GPU machine without network: torchtitan 0.2.2 and those of its trainer's imports
# that the GPU image lacks (its Python 3.12 already holds pyarrow, pandas, tensorboard, protobuf,
# absl-py, einops and xxhash), at the versions scripts/install_deps.sh installs
# here. About 2 MB: one carry of third_party/titan_wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
out=third_party/titan_wheels
rm -rf "$out"
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any -d "$out" \
  torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 tomli==2.5.0
ls "$out"
du -sh "$out"
