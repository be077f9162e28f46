#!/usr/bin/env bash
# Gathers the build dependencies that the GPU machines lack (GoogleTest sources, CLI11 and
# nlohmann-json headers, CUTLASS headers) into third_party/ (git-ignored), so that one `carry` of
# third_party/ lets those machines configure and build everything with no network.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh  # Debian packages and the CUTLASS headers
deps=third_party/host_deps
rm -rf "$deps"
mkdir -p "$deps/include"
cp -r /usr/src/googletest "$deps/googletest"
cp -r /usr/include/CLI "$deps/include/CLI"
cp -r /usr/include/nlohmann "$deps/include/nlohmann"
du -sh third_party
