"""torchtitan's own trainer (0.2.2) on the CPU, DeepSeek-V3's debug flavor, through
bench/titan_train.py (which makes the tokenizer and the data, and sets torchtitan's device to the
CPU): 20 steps with torchtitan's MoE, then 20 with the "moe_echo" model converter from the same
seed. The loss curves agree within 1e-4 per step (fp32 on both sides; the 100-step run in
bench/results/titan_cpu_deepseek_v3_debug_2026-11-28.json agrees within 4.8e-6 for 38 steps, then
drifts as routing flips accumulate, to at most 0.041 at step 74, 0.6%; the means of the last 10
steps differ by 0.003), the loss falls, and the swapped blocks share one Workspace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.models.moe.moe", reason="torchtitan 0.2.2 is not installed")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def run(tmp_path, label, *extra):
    out = tmp_path / f"{label}.json"
    cmd = [sys.executable, str(ROOT / "bench/titan_train.py"), "--cpu",
           "--config", str(ROOT / "bench/titan/deepseek_v3_debug.toml"),
           "--data", str(tmp_path / "data"), "--out", str(out), "--label", label,
           "--training.steps", str(STEPS), "--training.local_batch_size", "2",
           "--training.seq_len", "32", "--training.mixed_precision_param", "float32",
           "--job.dump_folder", str(tmp_path / label), *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_torchtitan_trainer_on_cpu_with_moe_echo_follows_its_own_moe(tmp_path):
    titan = run(tmp_path, "torchtitan")
    echo = run(tmp_path, "moe_echo", "--model.converters", "moe_echo",
               "--moe_echo.recompute", "experts")
    assert titan["converters"] == [] and echo["converters"] == ["moe_echo"]
    la, lb = titan["losses"], echo["losses"]
    assert len(la) == len(lb) == STEPS
    worst = max(abs(a - b) for a, b in zip(la, lb))
    assert worst < 1e-4, (la, lb)
    assert sum(lb[-5:]) / 5 < sum(lb[:5]) / 5 - 0.15, lb  # the loss falls (batches are noisy)
    # Five MoE blocks (layers 1-5) on one workspace.
    assert echo["workspace"]["modules"] == 5 and echo["workspace"]["bytes"] > 0
