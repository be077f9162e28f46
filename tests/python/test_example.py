"""The example model (examples/moe_lm) trains: its loss falls, and on the CPU in float32 its curve
with moe_echo.torch.MoE agrees with the same model on the plain PyTorch MoE block (same seed,
weights and batches) within 0.02 nats per step, and ECHO on equals ECHO off."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "moe_lm"))

import train  # noqa: E402

SMALL = ["--device", "cpu", "--layers", "2", "--hidden", "32", "--heads", "2", "--experts", "8",
         "--top-k", "2", "--ffn", "48", "--seq-len", "32", "--batch", "4", "--lr", "3e-3",
         "--log-every", "0", "--warmup", "1"]


def run(tmp_path, *extra):
    out = tmp_path / "record.json"
    rc = train.main(SMALL + ["--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_loss_falls_and_matches_plain_pytorch(tmp_path):
    rc, rec = run(tmp_path, "--steps", "40", "--compare", "torch", "--tolerance", "0.02")
    assert rc == 0
    assert rec["curves_agree"] and rec["max_abs_loss_diff"] <= 0.02
    losses = rec["runs"][0]["losses"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # from ~ln(256) = 5.5 down


def test_echo_on_equals_off(tmp_path):
    rc, rec = run(tmp_path, "--steps", "5", "--compare", "echo-off", "--tolerance", "0", "--smooth", "1")
    assert rc == 0
    assert rec["runs"][0]["losses"] == rec["runs"][1]["losses"]


def test_overlap_wgrad_trains_the_same_curve(tmp_path):
    # --overlap wgrad only reorders the backward's ops across streams: the same losses.
    rc, rec = run(tmp_path, "--steps", "5")
    assert rc == 0
    ref = tmp_path / "none.json"
    (tmp_path / "record.json").rename(ref)
    rc, rec2 = run(tmp_path, "--steps", "5", "--overlap", "wgrad", "--reference", str(ref),
                   "--tolerance", "0", "--smooth", "1")
    assert rc == 0
    assert rec2["runs"][0]["losses"] == rec["runs"][0]["losses"]


def test_one_workspace_trains_the_same_curve_in_less_memory(tmp_path):
    # --workspace binds the MoE blocks to one moe_echo.torch.Workspace: the same losses.
    rc, rec = run(tmp_path, "--steps", "4", "--layers", "3", "--recompute", "dispatch")
    assert rc == 0
    ref = tmp_path / "apart.json"
    (tmp_path / "record.json").rename(ref)
    rc, rec2 = run(tmp_path, "--steps", "4", "--layers", "3", "--recompute", "dispatch",
                   "--workspace", "--reference", str(ref), "--tolerance", "0", "--smooth", "1")
    assert rc == 0
    assert rec2["runs"][0]["losses"] == rec["runs"][0]["losses"]
    assert rec2["runs"][0]["moe_layer_bytes"] < rec["runs"][0]["moe_layer_bytes"]


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--experts", "0"])
    assert e.value.code == 2
    assert "--experts = 0 is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        train.main(["--batch", "8", "--micro-batches", "3"])
    assert e.value.code == 2
    assert "--micro-batches = 3 is invalid: allowed a divisor of --batch (8)" in \
        capsys.readouterr().err


def test_micro_batches_train_the_curve_of_the_whole_batch(tmp_path):
    # The batch in two micro-batches, gradients accumulated: the curve of the whole batch, up to
    # the order of sums (the aux loss, a function of each forward's token counts, off).
    rc, rec = run(tmp_path, "--steps", "10", "--aux-loss-coeff", "0")
    assert rc == 0
    ref = tmp_path / "whole.json"
    (tmp_path / "record.json").rename(ref)
    rc, rec2 = run(tmp_path, "--steps", "10", "--aux-loss-coeff", "0", "--micro-batches", "2",
                   "--reference", str(ref), "--tolerance", "1e-3", "--smooth", "1")
    assert rc == 0 and rec2["curves_agree"]


# The ranks' global batch is --batch 8: one process of --batch 8 trains on the same data. The aux
# loss is a per-rank term, so it is off for the comparison.
EP_RUN = ["--steps", "30", "--aux-loss-coeff", "0", "--tolerance", "0.02", "--smooth", "5"]


def ep_worker(rank, port, out, reference, extra):
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rc = train.main(SMALL + EP_RUN + ["--ep", "2", "--json", out, "--reference", reference] + extra)
    assert rc == 0


@pytest.mark.parametrize("extra", [[], ["--micro-batches", "2", "--echo-placement", "step"]],
                         ids=["one-batch", "micro-batches-step-placement"])
def test_expert_parallel_training_over_gloo_equals_one_process(tmp_path, extra):
    # Two processes (as torchrun starts them) train with the experts split over them and their
    # loss curve equals one process's on the same global batch; also with each rank's batch in
    # two micro-batches (gradients accumulated) and one clone placement per step, the first
    # backward holding its clone gradients.
    import socket

    import torch.multiprocessing as mp

    one = tmp_path / "one.json"
    assert train.main(SMALL + EP_RUN + ["--batch", "8", "--json", str(one)]) == 0
    with socket.socket() as s:  # a free loopback port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ep.json"
    mp.spawn(ep_worker, args=(port, str(out), str(one), extra), nprocs=2, join=True)
    rec = json.loads(out.read_text())
    losses = rec["runs"][0]["losses"]
    assert rec["config"]["ep"] == 2 and len(losses) == 30
    assert rec["curves_agree"] and rec["max_abs_smoothed_loss_diff"] <= 0.02
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    assert len(rec["runs"][0]["layer0_stats"]["load_after"]) == 2


def compare_worker(rank, port, out, plot):
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rc = train.main(SMALL + EP_RUN + ["--ep", "2", "--json", out, "--compare", "torch",
                                      "--plot", plot, "--log-every", "10"])
    assert rc == 0


def test_expert_parallel_compare_and_balance(tmp_path, capsys):
    # --compare at EP 2: the plain PyTorch block trains data-parallel on the same global batch
    # and its curve agrees; the record, the progress line and the plot carry the busiest rank's
    # rows over the mean without and with ECHO, per step.
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    mp.spawn(compare_worker, args=(port, str(out), str(png)), nprocs=2, join=True)
    rec = json.loads(out.read_text())
    assert rec["curves_agree"], rec["max_abs_smoothed_loss_diff"]
    echo, plain = rec["runs"]
    before, after = echo["busiest_over_mean_without_echo"], echo["busiest_over_mean_with_echo"]
    assert len(before) == len(after) == 30
    assert all(a <= b + 1e-9 for a, b in zip(after, before)) and min(before) >= 1.0
    assert "busiest_over_mean_without_echo" not in plain
    assert png.exists() and png.stat().st_size > 0


def test_reference_must_match_the_run(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": [{"losses": [1.0, 2.0]}]}))
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + ["--steps", "5", "--reference", str(bad)])
    assert e.value.code == 2
    assert "holds 2 steps, allowed a record of --steps (5)" in capsys.readouterr().err
