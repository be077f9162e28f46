#!/usr/bin/env bash
# Checks that every C++ and CUDA source (.cpp .hpp .cu .cuh .h under src, include, apps, tests,
# bench and python/ext) is formatted by .clang-format: clang-format 14 --dry-run --Werror, which
# prints each difference and fails on any. Installs clang-format 14 (Debian package
# clang-format-14) when it is missing. CLANG_FORMAT names another binary; FIX=1 reformats the
# files in place instead of checking.
set -euo pipefail
cd "$(dirname "$0")/.."

version=14
major() { "$1" --version 2>/dev/null | sed -n 's/.*clang-format version \([0-9]*\).*/\1/p'; }
find_clang_format() {
  for c in ${CLANG_FORMAT:-} clang-format-$version clang-format; do
    if command -v "$c" >/dev/null 2>&1 && [ "$(major "$c")" = "$version" ]; then
      echo "$c"
      return 0
    fi
  done
  return 1
}
if ! cf=$(find_clang_format); then
  echo "check_format: installing clang-format-$version"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "clang-format-$version"
  cf=$(find_clang_format) || {
    echo "check_format: no clang-format $version (versions format differently; set CLANG_FORMAT)" >&2
    exit 1
  }
fi

mapfile -t files < <(find src include apps tests bench python/ext -type f \
  \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) | sort)
if [ "${FIX:-0}" = 1 ]; then
  "$cf" -i --style=file "${files[@]}"
  echo "check_format: formatted ${#files[@]} files"
else
  "$cf" --dry-run --Werror --style=file "${files[@]}"
  echo "check_format: ${#files[@]} files formatted ($cf)"
fi
