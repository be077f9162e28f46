"""One NCCL per process: PyTorch's NCCL and moe_echo's NCCL communicator are the same
libnccl.so.2, of the version scripts/install_deps.sh pins (skipped in a build without NCCL)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import torch  # noqa: F401  (loads PyTorch's NCCL)
import torch.distributed  # noqa: F401

import moe_echo

pytestmark = pytest.mark.skipif(not moe_echo._ext.has_nccl(), reason="a build without NCCL")

ROOT = Path(__file__).resolve().parents[2]


def pinned() -> str:
    text = (ROOT / "scripts" / "install_deps.sh").read_text()
    return re.search(r"^nccl_version=([0-9.]+)$", text, re.M).group(1)


def test_torch_and_moe_echo_load_one_nccl():
    version = moe_echo._ext.nccl_version()  # our communicator's library, loaded
    paths = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
             if re.search(r"/libnccl\.so[.0-9]*$", line)}
    assert len(paths) == 1, paths
    assert version >= 22800, version


def test_the_nccl_that_runs_is_the_pinned_one():
    pin = pinned()
    installed = importlib.metadata.version("nvidia-nccl-cu13")
    if installed != pin:
        pytest.skip(f"nvidia-nccl-cu13 {installed} is installed, not the pinned {pin}: "
                    "scripts/install_deps.sh installs it")
    major, minor, patch = (int(x) for x in pin.split("."))
    assert moe_echo._ext.nccl_version() == major * 10000 + minor * 100 + patch
