"""A dead or stalled rank never leaves the others spinning: on a machine with N GPUs, N ranks
(--ranks, default 2) train on the sync-free NCCL communicator (eager, or replayed from one
captured CUDA graph) until this driver kills rank 1 (SIGKILL) or stops it (SIGSTOP) mid-run;
then every other rank must end within LIMIT_S seconds, the job's output must name the missing
rank, and no process of the job may be left (the stopped one included) nor any process on a GPU.

The ranks run under `moe-echo launch` (the C++ `moe-echo bench --ep N`, and the Python worker
tests/gpu/dead_rank_worker.py) and under torchrun (the Python worker). Prints a table and writes
dead_rank.json under --out. Exit status 1 when a case fails.

    python3 tests/gpu/dead_rank.py --build build-gpu --out out/dead_rank [--ranks N]
        [--cases launch-bench-eager-kill,...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

LIMIT_S = 60.0
HERE = Path(__file__).resolve().parent
WORKER = HERE / "dead_rank_worker.py"


def cases(build: Path, ranks: int) -> dict[str, tuple[list[str], str]]:
    """name -> (command, how the driver learns the ranks are stepping: 'python' or 'bench')."""
    exe = str(build / "moe-echo")
    n = str(ranks)
    launch = [exe, "launch", "-n", n, "--master-port", "0", "--"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", n]
    bench = [exe, "bench", "--ep", n, "--steps", "1000000", "--preset", "qwen3-30b-a3b"]
    out = {}
    for fault in ("kill", "stop"):
        for mode in ("eager", "graph"):
            out[f"launch-bench-{mode}-{fault}"] = (
                launch + bench + ["--capture", "on" if mode == "graph" else "off"], "bench")
            out[f"launch-python-{mode}-{fault}"] = (
                launch + [sys.executable, str(WORKER), "--mode", mode], "python")
            out[f"torchrun-python-{mode}-{fault}"] = (
                torchrun + [str(WORKER), "--mode", mode], "python")
    return out


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def rank_pid(root: int, rank: int, marker: str) -> int | None:
    """The job's process of `rank` whose command line holds `marker` (the deepest such one)."""
    found = None
    for pid in descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and marker in cmd:
            found = pid
    return found


def gpu_pids() -> list[int]:
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                       capture_output=True, text=True)
    return [int(x) for x in r.stdout.split() if x.strip().isdigit()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] not in "ZX"


def run_case(name: str, cmd: list[str], kind: str, env: dict, ranks: int) -> dict:
    fault = name.rsplit("-", 1)[1]
    lines: list[tuple[float, str]] = []
    t_start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # Strike once the ranks are stepping: the Python worker's step lines; for bench (whose
    # table rows a pipe buffers), 20 s after every rank is on its GPU.
    stepping = re.compile(r"rank 1 step [3-9]")
    marker = "dead_rank_worker.py" if kind == "python" else "bench"
    victim, on_gpus = None, None
    while time.monotonic() - t_start < 300 and proc.poll() is None:
        if kind == "python":
            ready = any(stepping.search(l) for _, l in lines)
        else:
            if on_gpus is None and len(gpu_pids()) >= ranks:
                on_gpus = time.monotonic()
            ready = on_gpus is not None and time.monotonic() - on_gpus > 20
        if ready:
            victim = rank_pid(proc.pid, 1, marker)
            if victim:
                break
        time.sleep(0.5)
    result = dict(case=name, command=" ".join(cmd))
    if victim is None:
        result.update(ok=False, why="the ranks never reached a step (or rank 1 was not found)")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        result["output_tail"] = [l for _, l in lines[-30:]]
        return result
    t_fault = time.monotonic()
    os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        rc = proc.wait(timeout=LIMIT_S + 60)
    except subprocess.TimeoutExpired:
        rc = None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ended_s = time.monotonic() - t_fault
    reader.join(timeout=5)
    after = [l for t, l in lines if t >= t_fault]
    left = [p for p in [victim] + descendants(proc.pid) if alive(p)]
    for p in left:  # the driver cleans up what the job left, after noting it
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    gpu_left = gpu_pids()
    for _ in range(20):
        if not gpu_left:
            break
        time.sleep(0.5)
        gpu_left = gpu_pids()
    # Ours and the launchers' words: "rank 1 (pid P) exited", "rank 1 was killed by signal 9",
    # torchrun's failure summary ("rank : 1 (local_rank: 1)" beside "Signal 9 (SIGKILL)").
    cause = re.compile(r"exited|stopped|killed|closed|did not arrive|Signal 9|SIGKILL|exitcode")
    names_rank = [l for l in after if re.search(r"\brank\s*:?\s*1\b", l)]
    if not any(cause.search(l) for l in after):
        names_rank = []
    ok = (rc is not None and ended_s <= LIMIT_S and bool(names_rank) and not left
          and not gpu_left)
    result.update(ok=ok, victim_pid=victim, fault=fault, exit_code=rc, ended_s=round(ended_s, 2),
                  message=names_rank[:3], processes_left=left, gpu_processes_left=gpu_left,
                  output_after_fault=after[-40:])
    if kind == "python" and fault == "stop" and "eager" in name:
        # An eager step comes back to the library's host code: the loss must reach the program
        # as an exception (not only as the monitor's exit).
        result["runtime_error"] = any("RuntimeError" in l and "rank 1" in l for l in after)
        result["ok"] = ok and result["runtime_error"]
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build-gpu")
    p.add_argument("--out", default="out/dead_rank")
    p.add_argument("--cases", default="", help="comma-separated names (default: all)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the job (rank 1 is struck)")
    a = p.parse_args()
    if a.ranks < 2:
        print(f"--ranks = {a.ranks} is invalid: allowed 2 or more", file=sys.stderr)
        return 2
    all_cases = cases(Path(a.build).resolve(), a.ranks)
    pick = [c for c in a.cases.split(",") if c] or list(all_cases)
    unknown = [c for c in pick if c not in all_cases]
    if unknown:
        print(f"unknown cases {unknown}; allowed: {', '.join(all_cases)}", file=sys.stderr)
        return 2
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(Path(a.build).resolve() / "python") + os.pathsep + env.get(
        "PYTHONPATH", "")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in pick:
        cmd, kind = all_cases[name]
        r = run_case(name, cmd, kind, env, a.ranks)
        results.append(r)
        print(f"{name:<32} {'ok' if r['ok'] else 'FAIL':<5} ended {r.get('ended_s', '-')} s "
              f"exit {r.get('exit_code', '-')}  {(r.get('message') or [r.get('why', '')])[0][:110]}",
              flush=True)
        (out / "dead_rank.json").write_text(json.dumps(
            dict(limit_s=LIMIT_S, ranks=a.ranks, results=results), indent=1))
    failed = [r["case"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} cases ok" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
