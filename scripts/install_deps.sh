#!/usr/bin/env bash
# Installs what MoE Echo needs to build and test: Debian packages; the Python packages of the
# moe_echo package and its tests from PyPI (PyTorch 2.11, nanobind, scikit-build-core, pytest,
# numpy); and, where nvcc exists, the CUTLASS 4.2 headers of the pinned PyPI wheel (into the
# git-ignored third_party/cutlass).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake ninja-build g++ libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi

# CUDA builds need the CUTLASS 4.2 headers: the pinned PyPI wheel's, copied into third_party/.
if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } && [ ! -f third_party/cutlass/include/cutlass/cutlass.h ]; then
  echo "setup: installing CUTLASS 4.2 headers (nvidia-cutlass==4.2.0.0) into third_party/cutlass"
  tmp=$(mktemp -d)
  python3 -m pip install -q --root-user-action=ignore --no-deps --target "$tmp" nvidia-cutlass==4.2.0.0
  mkdir -p third_party/cutlass/tools/util
  rm -rf third_party/cutlass/include third_party/cutlass/tools/util/include
  cp -r "$tmp/cutlass_library/source/include" third_party/cutlass/include
  cp -r "$tmp/cutlass_library/source/tools/util/include" third_party/cutlass/tools/util/include
  rm -rf "$tmp"
fi

# The Python package's build and test requirements (PyTorch and transformers pinned to the GPU
# machines' 2.11 and 5.17; transformers for moe_echo.torch.swap_moe and its tests; torchtitan
# 0.2.2 for moe_echo.torch.swap_titan_moe and its tests: the newest torchtitan whose models and
# trainer run on torch 2.11, as 0.3.0's import torch.distributed.fsdp.DataParallelMeshDims of a
# later torch).
python_packages=("torch==2.11.0" "transformers==5.17.0" "torchtitan==0.2.2" "nanobind>=2.0"
                 "scikit-build-core>=0.10" "pytest" "pytest-timeout" "numpy" "matplotlib")
if ! python3 - <<'PY' >/dev/null 2>&1
import importlib.metadata as m, sys
need = {"torch": "2.11.", "transformers": "5.17.", "torchtitan": "0.2.2", "nanobind": "",
        "scikit-build-core": "", "pytest": "", "pytest-timeout": "", "numpy": "",
        "matplotlib": ""}
sys.exit(any(not m.version(k).startswith(v) for k, v in need.items()))
PY
then
  echo "setup: installing ${python_packages[*]} (pip)"
  python3 -m pip install -q --root-user-action=ignore "${python_packages[@]}"
fi

# NCCL, pinned where the CUDA code is built (nvcc present): the multi-GPU communicator is built
# against the nvidia-nccl-cu13 package (CMakeLists.txt looks there first), and PyTorch's NCCL
# process groups load the same libnccl.so.2, so one process holds one NCCL. torch 2.11 names
# 2.28.9; NCCL keeps its ABI across 2.x, and pip's note that torch's pin is unmet is expected.
nccl_version=2.32.3
if command -v nvcc >/dev/null 2>&1 &&
  ! python3 -c "import importlib.metadata as m, sys; sys.exit(m.version('nvidia-nccl-cu13') != '$nccl_version')" >/dev/null 2>&1; then
  echo "setup: installing nvidia-nccl-cu13==$nccl_version (pip)"
  python3 -m pip install -q --root-user-action=ignore --no-deps "nvidia-nccl-cu13==$nccl_version" 2>&1 |
    grep -v -E "dependency resolver|requires nvidia-nccl-cu13==" || true
fi
