"""bench/peers_bench.py on the CPU (--tiny): its fp32 reference against the tests' own reference,
its synthetic routing against the law it draws from, the peers that are installed here against
the reference (MoE Echo and the script's torch block always; torchtitan, Megatron-Core and
transformers when they import), a peer with the wrong weight layout caught by the check, a
missing package reported by name with its error while the others run, and the table's ratios."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from reference import reference_moe, rel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import peers_bench  # noqa: E402
from peers import adapters, cases  # noqa: E402

PEERS_ON_CPU = ["moe-echo", "moe-echo-recompute", "torchtitan", "megatron", "hf-grouped_mm",
                "torch-compiled"]
# need nothing beyond this repository and torch
ALWAYS = ["moe-echo", "moe-echo-recompute", "torch-compiled"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes gain nothing from threads, and on a busy CI machine they lose seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_case(slice_name="mixtral-8x7b", routing="zipf:1.2", tokens=96, dtype=torch.float64):
    return cases.make_case(slice_name, cases.TINY_SLICES[slice_name], routing, tokens,
                           device=torch.device("cpu"), dtype=dtype)


def test_reference_equals_the_tests_reference():
    case = tiny_case("deepseek-v3")
    ref = cases.reference(case)
    x, wr, w1, w2 = (t.clone().requires_grad_(True) for t in (case.x, case.router, case.w1,
                                                              case.w2))
    y, _, _, idx, _ = reference_moe(x, wr, w1, w2, top_k=case.top_k)
    y.backward(case.dy)
    assert torch.equal(torch.sort(idx, -1).values, torch.sort(ref["top_i"], -1).values)
    for name, got, want in [("y", ref["y"], y), ("dx", ref["dx"], x.grad),
                            ("router", ref["router"], wr.grad), ("w1", ref["w1"], w1.grad),
                            ("w2", ref["w2"], w2.grad)]:
        assert rel(got, want) < 1e-12, name


def inclusion_top2(p: torch.Tensor) -> torch.Tensor:
    """P(expert e among the 2 drawn without replacement, probabilities p)."""
    others = p.unsqueeze(0) * p.unsqueeze(1) / (1 - p.unsqueeze(0))  # [e, j]: j first, then e
    others.fill_diagonal_(0)
    return p + others.sum(1)


@pytest.mark.parametrize("routing", ["uniform", "zipf:1.2"])
def test_synthetic_routing_draws_from_its_law(routing):
    tokens = 8192
    case = tiny_case("mixtral-8x7b", routing, tokens)  # E 8, top-2
    top_i, _ = cases.route(case.x, case.router, case.top_k)
    p = case.logp.exp()
    want = inclusion_top2(p)
    got = torch.bincount(top_i.reshape(-1), minlength=case.experts).double() / tokens
    sigma = (want * (1 - want) / tokens).sqrt()
    assert ((got - want).abs() <= 5 * sigma + 1e-9).all(), (got, want)
    load = cases.load_max_over_mean(top_i, case.experts)
    if routing == "uniform":
        assert load < 1.1
    else:
        assert load > 2.0  # the hottest of 8 experts takes over a quarter of the rows


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers") / "tiny.json"
    doc = peers_bench.main(["--device", "cpu", "--tiny", "--out", str(out), "--routings",
                            "uniform,zipf:1.2", "--slices", "qwen3-30b-a3b", "--peers",
                            ",".join(PEERS_ON_CPU)])
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(doc["results"],
                                                                           default=str))
    return doc


def test_installed_peers_agree_with_the_reference(tiny_run):
    ran = [n for n in PEERS_ON_CPU if tiny_run["peers"][n]["status"] == "importable"]
    assert set(ALWAYS) <= set(ran)
    for rec in tiny_run["results"]:
        assert rec["peer"] in ran
        assert rec["status"] == "ok", rec
        assert rec["agrees"], rec
        assert set(rec["rel_err"]) == {"y", "dx", "w1", "w2", "router"}
        if "routing_agreement" in rec:
            assert rec["routing_agreement"] == 1.0, rec
    assert len(tiny_run["results"]) == 2 * len(ran)
    # MoE Echo on the CPU computes in float32 like the reference: far inside the bf16 tolerance.
    ours = [r for r in tiny_run["results"] if r["peer"] == "moe-echo"]
    assert max(max(r["rel_err"].values()) for r in ours) < 1e-4


def test_in_bf16_the_installed_peers_agree_and_route_alike(tmp_path):
    """The GPU's dtype on the CPU: every peer's bf16 path (transformers' fp32 gate beside bf16
    experts, Megatron's bf16 config, torchtitan's casts) within the bf16 tolerance."""
    doc = peers_bench.main(["--device", "cpu", "--tiny", "--cpu-dtype", "bfloat16", "--out",
                            str(tmp_path / "bf16.json"), "--slices", "mixtral-8x7b",
                            "--routings", "zipf:1.2", "--peers", ",".join(PEERS_ON_CPU)])
    assert {r["peer"] for r in doc["results"]} >= set(ALWAYS)
    for rec in doc["results"]:
        assert rec["status"] == "ok" and rec["agrees"] and rec["tol"] == 3e-2, rec
        assert rec.get("routing_agreement", 1.0) == 1.0, rec


def test_peers_that_do_not_run_say_why(tiny_run):
    for n in PEERS_ON_CPU:
        d = tiny_run["peers"][n]
        if d["status"] == "not installed":
            assert d["package"] and d["error"]
        elif d["status"] != "importable":  # imported, but cannot run here (and says why)
            assert d["status"] == "not run" and d["reason"]


def _swapped_gate_up(case, ctx):
    """The torch block with gate and up exchanged: what a wrong fc1 layout computes."""
    F = case.ffn
    bad = cases.Case(**{**case.__dict__, "w1": torch.cat([case.w1[..., F:], case.w1[..., :F]],
                                                         dim=-1)})
    return adapters.build_torch_compiled(bad, ctx)


def test_a_peer_with_the_wrong_layout_fails_its_check_and_a_missing_one_is_named(
        tmp_path, monkeypatch):
    monkeypatch.setitem(adapters.PEERS, "swapped", adapters.Peer(
        "swapped", "gate and up exchanged", (("torch", "torch"),), _swapped_gate_up,
        devices=("cpu",), exact_on_cpu=True))
    monkeypatch.setitem(adapters.PEERS, "absent", adapters.Peer(
        "absent", "a package that is not there", (("no_such_module_xyz", "no-such-pkg==1.0"),),
        adapters.build_torch_compiled, devices=("cpu",)))
    doc = peers_bench.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "t.json"),
                            "--slices", "mixtral-8x7b", "--routings", "uniform", "--peers",
                            "swapped,absent,torch-compiled"])
    recs = {r["peer"]: r for r in doc["results"]}
    assert recs["swapped"]["status"] == "ok" and not recs["swapped"]["agrees"]
    assert recs["swapped"]["rel_err"]["y"] > 0.1
    assert recs["torch-compiled"]["agrees"]
    assert "absent" not in recs
    absent = doc["peers"]["absent"]
    assert absent["status"] == "not installed" and absent["package"] == "no-such-pkg==1.0"
    assert "No module named 'no_such_module_xyz'" in absent["error"]


def test_groups_padded_to_16_rows_give_the_same_layer(tmp_path, monkeypatch):
    """pad_groups (what the torchao FP8 peer needs: group sizes in multiples of 16) lays each
    expert's rows at a 16-aligned start with zero rows after them, and the padded torch block, the
    FP8 peer's layout (ENH) with bf16-free GEMMs, agrees with the reference."""
    xs = torch.arange(10.0).repeat_interleave(2).view(10, 2)
    counts = torch.tensor([3, 0, 6, 1])
    out, ends, dest = adapters.pad_groups(xs, counts, 16)
    assert ends.tolist() == [16, 16, 32, 48] and ends.dtype == torch.int32
    assert dest.tolist() == [0, 1, 2, 16, 17, 18, 19, 20, 21, 32]
    assert out.shape == (10 + 4 * 15, 2) and torch.equal(out[dest], xs)
    mask = torch.ones(out.shape[0], dtype=torch.bool)
    mask[dest] = False
    assert not out[mask].any()

    def padded(case, ctx):
        return adapters._torch_block(
            case, ctx, lambda a, b, offs: torch._grouped_mm(a, b, offs=offs), "ENH",
            "padded", align=16)

    monkeypatch.setitem(adapters.PEERS, "padded", adapters.Peer(
        "padded", "the torch block, groups padded to 16", (("torch", "torch"),), padded,
        devices=("cpu",), exact_on_cpu=True))
    doc = peers_bench.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "p.json"),
                            "--slices", "deepseek-v3", "--routings", "zipf:1.2", "--peers",
                            "padded"])
    (rec,) = doc["results"]
    assert rec["status"] == "ok" and rec["agrees"], rec


def test_our_layer_tells_what_it_holds_on_a_shared_workspace():
    """The memory measurement's act_bytes_on_workspace counts MoE Echo's layer_bytes (routing,
    kept activations, parameters and gradients): more than nothing, less than the layer's own
    workspace, whose receive windows and temporaries a model's layers share."""
    case = tiny_case("qwen3-30b-a3b", "uniform", dtype=torch.float32)
    ctx = adapters.Ctx(device=torch.device("cpu"), dtype=torch.float32, compile=False)
    built = adapters.build_moe_echo(case, ctx)
    assert 0 < built.layer_bytes() < built.extra_bytes()
    torch_block = adapters.build_torch_compiled(case, ctx)
    assert torch_block.layer_bytes is None and torch_block.extra_bytes() == 0


def test_table_gives_each_ratio_against_its_target():
    def rec(peer, ms, precision="bf16", agrees=True, act=None, kept=None, ep=1):
        r = dict(peer=peer, slice="deepseek-v3", routing="uniform", ep_size=ep, status="ok",
                 fwd_bwd_ms=ms, precision=precision, agrees=agrees, act_bytes=act)
        if kept is not None:
            r["act_bytes_on_workspace"] = kept
        return r

    doc = dict(results=[rec("moe-echo", 30.0, act=100, kept=88), rec("torchtitan", 40.0),
                        rec("moe-echo-recompute", 10.0, act=90, kept=56),
                        rec("megatron", 35.0, agrees=False), rec("moe-echo-fp8", 20.0, "fp8"),
                        rec("torchao-fp8", 25.0, "fp8"), rec("sonicmoe", 50.0, act=80)])
    row = peers_bench.summarize([doc]).splitlines()[2]
    assert "35.00 x" in row                       # megatron failed its check: marked,
    assert "0.75 (met, <= 0.85)" in row           # not the best bf16 peer (30 / 40), nor ours
    assert "0.80 (met, <= 0.9)" in row            # FP8: 20 / 25
    assert "1.10 (not met, <= 1.0)" in row        # kept on a workspace: 88 / 80
    assert "0.70 (met, <= 1.0)" in row            # recompute="all_but_fc1": 56 / 80


def test_expert_parallel_over_two_processes_agrees_with_the_reference(tmp_path):
    """--ep 2 over gloo: each rank its own tokens and half the experts; the expert gradients
    against the reference's summed over both ranks' tokens."""
    import os
    import subprocess

    out = tmp_path / "ep2.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "bench" / "peers_bench.py"), "--device", "cpu", "--tiny", "--ep", "2",
           "--out", str(out), "--slices", "mixtral-8x7b", "--routings", "zipf:1.2", "--peers",
           "moe-echo,megatron"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    recs = {r["peer"]: r for r in doc["results"]}
    assert "moe-echo" in recs
    for r in recs.values():
        assert r["ep_size"] == 2 and len(r["ranks"]) == 2
        assert r["status"] == "ok" and r["agrees"], r
        # the two ranks' tokens differ, so must their outputs' errors (each rank was checked)
        assert r["ranks"][0]["rel_err"] != r["ranks"][1]["rel_err"]
