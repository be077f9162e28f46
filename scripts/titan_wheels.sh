#!/usr/bin/env bash
# Gathers torchtitan 0.2.2 and what its trainer imports (the versions scripts/install_deps.sh
# installs here) as wheels into third_party/wheels/ (git-ignored), for bench/titan_round.sh on a
# GPU machine without network: pyarrow (55 MB) in third_party/wheels/arrow, the rest (18 MB) in
# third_party/wheels/rest, two carries under the 64 MiB one carry holds.
set -euo pipefail
cd "$(dirname "$0")/.."
dl() { python3 -m pip download -q --no-deps --only-binary :all: -d "$1" "${@:2}"; }
rm -rf third_party/wheels
dl third_party/wheels/arrow pyarrow==26.0.1
dl third_party/wheels/rest torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 \
  typeguard==4.6.1 datasets==5.2.0 pandas==3.1.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 \
  tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 tomli==2.5.0 einops==0.8.2
du -sh third_party/wheels/*
