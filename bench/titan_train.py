"""torchtitan's own trainer (torchtitan 0.2.2, ``torchtitan.train.Trainer``) on one rank, with its
MoE or with MoE Echo's (the ``"moe_echo"`` model converter), recording every step's loss,
tokens/s and peak memory as JSON.

    python3 bench/titan_train.py --config bench/titan/deepseek_v3_debug.toml --out run.json \
        [--cpu] [--derive 16B:8] [torchtitan CLI overrides, e.g. --model.converters moe_echo]

- The tokenizer and the data set are made here (``--data``, default /tmp/moe_echo_titan_data):
  a word-level tokenizer of 512 tokens and 4000 documents drawn from a fixed random walk over
  them, so that no download is needed and a model has something to learn. The config's
  hf_assets_path and training.dataset_path are pointed at them (torchtitan's ``c4_test`` loader:
  a local folder of JSON lines).
- ``--cpu``: torchtitan 0.2.2 takes CUDA when torch finds no accelerator
  (``_get_available_device_type() or "cuda"``) and its memory monitor calls CUDA's memory
  functions; here its device is the CPU and the monitor reads zeros. Its MoE router counts
  tokens with ``torch.histc`` on int64, which torch has on CUDA only: the run goes under a torch
  function mode that gives the same counts through ``torch.bincount``. One intra-op thread.
- ``--derive FLAVOR:LAYERS``: a flavor of the model's registry with another number of layers
  (``FLAVOR_LLAYERS``, e.g. 16B_L8), for a real shape that fits one GPU.
- torchtitan's own flags follow (``--compile.enable``, ``--training.steps``, ...). With
  ``--model.converters moe_echo`` the script imports ``moe_echo.torch.titan_job`` as the job's
  custom config module, so the ``[moe_echo]`` options (``--moe_echo.recompute`` ...) are accepted.

The JSON: the arguments, torchtitan's version, per step ``loss``, ``grad_norm``, ``tps`` and
``max_reserved_gib`` / ``max_active_gib`` (torchtitan's own metrics, logged every step), the
mean tokens/s over the steps after ``--warmup``, the peak memory over the run, and, with the
converter, the Workspace's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import types


def make_data(folder: str, vocab_words: int = 509, documents: int = 4000) -> tuple[str, str]:
    """A tokenizer folder and a data folder under `folder` (made once)."""
    tok, data = os.path.join(folder, "tokenizer"), os.path.join(folder, "data")
    if os.path.exists(os.path.join(data, "train.json")):
        return tok, data
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(vocab_words)]
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    for w in words:
        vocab[w] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(tok, exist_ok=True)
    tokenizer.save(os.path.join(tok, "tokenizer.json"))
    with open(os.path.join(tok, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    os.makedirs(data, exist_ok=True)
    rng = random.Random(0)
    with open(os.path.join(data, "train.json"), "w") as f:
        for _ in range(documents):
            w, out = rng.randrange(vocab_words), []
            for _ in range(rng.randrange(100, 400)):
                out.append(words[w])
                w = (w * 7 + rng.choice((1, 2, 3))) % vocab_words
            f.write(json.dumps({"text": " ".join(out)}) + "\n")
    return tok, data


def cpu_device():
    """torchtitan's device made the CPU: must run before torchtitan is imported."""
    import torch
    import torch._utils as tu

    mod = types.SimpleNamespace(
        set_device=lambda d: None, current_device=lambda: 0, synchronize=lambda *a: None,
        device_count=lambda: 1, is_available=lambda: True, empty_cache=lambda: None,
        get_device_name=lambda d=None: "cpu", reset_peak_memory_stats=lambda *a: None,
        memory_stats=lambda *a: {},
        get_device_properties=lambda d=None: types.SimpleNamespace(total_memory=1 << 40),
    )
    if "torchtitan" in sys.modules:
        raise RuntimeError("--cpu must set torchtitan's device before torchtitan is imported")
    before = tu._get_available_device_type, tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type=None: mod
    try:
        import torchtitan.tools.utils as tt_utils
    finally:
        tu._get_available_device_type, tu._get_device_module = before
    assert tt_utils.device_type == "cpu"
    torch.set_num_threads(1)

    from torch.overrides import TorchFunctionMode

    class IntHistc(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.histc and not args[0].is_floating_point():
                x = args[0]
                bins = kwargs.get("bins", args[1] if len(args) > 1 else 100)
                lo = int(kwargs.get("min", args[2] if len(args) > 2 else 0))
                v = x.reshape(-1) - lo
                return torch.bincount(v[(v >= 0) & (v < bins)], minlength=bins).to(x.dtype)
            return func(*args, **kwargs)

    return IntHistc()


def memory_phases(trainer, at_step: int, cuda: bool = True) -> dict:
    """Hooks that fill the returned dict at optimizer step `at_step`: torch's allocated GiB when
    the step's forward starts, its peak over forward+backward, its allocated GiB and live
    tensors (64 MiB or more, by shape and dtype, parameters and gradients told apart) when the
    optimizer step starts, and its peak over the optimizer step. On the CPU (`cuda` False) only
    the live tensors, of 64 KiB or more, each storage once."""
    import gc

    import torch
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    gib = 2.0**30
    out: dict = {}
    state = dict(step=0, forwards=0)
    model = trainer.model_parts[0]

    def forward_pre(module, inputs):
        if state["step"] == at_step - 1 and state["forwards"] == 0 and cuda:
            torch.cuda.synchronize()
            out["allocated_at_forward_gib"] = torch.cuda.memory_allocated() / gib
            torch.cuda.reset_peak_memory_stats()
        state["forwards"] += 1

    def step_pre(opt, args, kwargs):
        # torchtitan's optimizer container is an Optimizer whose step runs the inner ones':
        # only the outermost step counts.
        state["depth"] = state.get("depth", 0) + 1
        if state["depth"] > 1 or state["step"] != at_step - 1:
            return
        if cuda:
            torch.cuda.synchronize()
            out["peak_forward_backward_gib"] = torch.cuda.max_memory_allocated() / gib
            out["allocated_at_optimizer_gib"] = torch.cuda.memory_allocated() / gib
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters()
                 if p.grad is not None}
        device = "cuda" if cuda else "cpu"
        min_bytes = 64 * 2**20 if cuda else 64 * 2**10
        seen, live = set(), {}
        for o in gc.get_objects():
            try:
                if not (isinstance(o, torch.Tensor) and o.device.type == device):
                    continue
                st = o.untyped_storage()
                ptr, nbytes = st.data_ptr(), st.nbytes()
            except Exception:  # noqa: BLE001 (objects gc lists need not be whole tensors)
                continue
            if nbytes < min_bytes or ptr in seen:
                continue
            seen.add(ptr)
            kind = "param" if ptr in params else "grad" if ptr in grads else "other"
            key = f"{kind} {tuple(o.shape)} {str(o.dtype).replace('torch.', '')}"
            n, b = live.get(key, (0, 0.0))
            live[key] = (n + 1, b + nbytes / gib)
        out["live_storages"] = {k: dict(count=n, gib=round(b, 6))
                                for k, (n, b) in sorted(live.items(), key=lambda kv: -kv[1][1])}
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    def step_post(opt, args, kwargs):
        state["depth"] -= 1
        if state["depth"] > 0:
            return
        if state["step"] == at_step - 1 and cuda:
            torch.cuda.synchronize()
            out["peak_optimizer_gib"] = torch.cuda.max_memory_allocated() / gib
        state["step"] += 1
        state["forwards"] = 0

    model.register_forward_pre_hook(forward_pre)
    register_optimizer_step_pre_hook(step_pre)
    register_optimizer_step_post_hook(step_post)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="torchtitan job TOML")
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--cpu", action="store_true", help="run torchtitan's trainer on the CPU")
    ap.add_argument("--data", default="/tmp/moe_echo_titan_data")
    ap.add_argument("--derive", default="", help="FLAVOR:LAYERS, a flavor with LAYERS layers")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the mean tokens/s")
    ap.add_argument("--label", default="", help="a name for the run in the JSON")
    ap.add_argument("--memory-phases", type=int, default=0, metavar="STEP",
                    help="at optimizer step STEP (CUDA): torch's peak allocated memory over the "
                    "forward+backward and over the optimizer step, and the live tensors of 64 MiB "
                    "or more (64 KiB on the CPU) at the optimizer step, each storage once, "
                    "grouped by shape and dtype")
    args, titan_args = ap.parse_known_args()

    mode = cpu_device() if args.cpu else None
    for k, v in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(k, v)
    import torch
    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.protocols import train_spec as train_spec_module
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    tok, data = make_data(args.data)
    cli = ["--job.config_file", args.config, "--model.hf_assets_path", tok,
           "--training.dataset_path", data]
    converter = any("moe_echo" in a for a in titan_args)
    if converter:
        cli += ["--job.custom_config_module", "moe_echo.torch.titan_job"]
    config = ConfigManager().parse_args(cli + titan_args)
    if args.derive:
        import copy

        flavor, layers = args.derive.split(":")
        spec = train_spec_module.get_train_spec(config.model.name)
        derived = copy.deepcopy(spec.model_args[flavor])
        derived.n_layers = int(layers)
        name = f"{flavor}_L{layers}"
        spec.model_args[name] = derived
        config.model.flavor = name

    steps = []

    class Recorder:
        def __init__(self, inner):
            self.inner = inner

        def log(self, metrics, step):
            steps.append(dict(
                step=step, loss=metrics["loss_metrics/global_avg_loss"],
                grad_norm=float(metrics["grad_norm"]), tps=metrics["throughput(tps)"],
                max_active_gib=metrics["memory/max_active(GiB)"],
                max_reserved_gib=metrics["memory/max_reserved(GiB)"]))
            self.inner.log(metrics, step)

        def close(self):
            self.inner.close()

    if mode is not None:
        mode.__enter__()
    t0 = time.time()
    trainer = Trainer(config)
    trainer.metrics_processor.logger = Recorder(trainer.metrics_processor.logger)
    phases = (memory_phases(trainer, args.memory_phases, cuda=not args.cpu)
              if args.memory_phases else None)
    try:
        trainer.train()
    finally:
        workspace = None
        if converter:
            from moe_echo.torch.titan import titan_workspace

            ws = titan_workspace(trainer.model_parts[0])
            if ws is not None:
                workspace = dict(bytes=ws.bytes, layer_bytes=ws.layer_bytes,
                                 modules=len(ws.modules))
        peak = (torch.cuda.max_memory_allocated() / 2**30
                if torch.cuda.is_available() and not args.cpu else None)
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if mode is not None:
            mode.__exit__(None, None, None)
    late = [s["tps"] for s in steps if s["step"] > args.warmup]
    result = dict(
        label=args.label, config=args.config, titan_args=titan_args, cpu=args.cpu,
        derive=args.derive, model=config.model.name, flavor=config.model.flavor,
        torchtitan=getattr(torchtitan, "__version__", "?"), torch=torch.__version__,
        local_batch_size=config.training.local_batch_size, seq_len=config.training.seq_len,
        converters=list(config.model.converters), compile=config.compile.enable,
        steps=steps, losses=[s["loss"] for s in steps],
        mean_tps=sum(late) / len(late) if late else None,
        max_reserved_gib=max((s["max_reserved_gib"] for s in steps), default=None),
        max_active_gib=max((s["max_active_gib"] for s in steps), default=None),
        max_allocated_gib=peak, workspace=workspace, wall_s=time.time() - t0,
        memory_phases=phases,
        device=(torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu
                else "cpu"),
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}))


if __name__ == "__main__":
    main()
