"""The interpreter exits cleanly: a program that ends with modules, optimizers and outputs still
alive (README's snippet, docs/python.md's, and one holding a workspace, a copy and a graph)
prints nothing on stderr, in particular no nanobind leak warnings ("leaked 1 instances")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import moe_echo

ROOT = Path(__file__).resolve().parents[2]

HELD_AT_EXIT = """
import copy
import torch
from torch import nn
from moe_echo.torch import MoE, Workspace

layers = nn.ModuleList(MoE(32, 16, 8, 2, max_tokens=64) for _ in range(2))
ws = Workspace(layers)
twin = copy.deepcopy(layers[0])
opt = torch.optim.AdamW([*layers.parameters(), *twin.parameters()], lr=1e-3)
x = torch.randn(64, 32, requires_grad=True)
y = twin(layers[1](layers[0](x)))  # its graph, alive at exit, holds every parameter
y.sum().backward(retain_graph=True)
opt.step()
"""


def snippets(path):
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), flags=re.S)


def run(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that imports this moe_echo."""
    env = dict(os.environ)
    package_root = str(Path(moe_echo.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.parametrize("name,code", [("README.md", snippets("README.md")[0]),
                                       ("docs/python.md", snippets("docs/python.md")[0]),
                                       ("held at exit", HELD_AT_EXIT)])
def test_exit_prints_nothing_on_stderr(name, code):
    r = run(code)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", f"{name}: stderr at exit:\n{r.stderr}"
