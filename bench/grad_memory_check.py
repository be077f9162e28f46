"""Where a MoE module's persistent torch memory goes between steps (CUDA): a model of L MoE
modules (fp32 parameters, bf16 autocast, one Workspace) trained for a few steps with AdamW,
eager and compiled, printing torch's allocated bytes after zero_grad against what parameters and
AdamW's moments need, and which parameters' .grad tensors survive zero_grad."""

import argparse
import gc
import json

import torch
from torch import nn

from moe_echo.torch import MoE, Workspace

DEV = "cuda"


class Net(nn.Module):
    def __init__(self, layers, H, F, E, K, T):
        super().__init__()
        self.moes = nn.ModuleList(MoE(H, F, E, K, max_tokens=T, device=DEV) for _ in range(layers))

    def forward(self, x):
        for m in self.moes:
            x = x + m(x)
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a smoke run)")
    args = ap.parse_args()
    global DEV
    DEV = "cpu" if args.small else "cuda"
    cuda = DEV == "cuda"
    H, F, E, K, T = (64, 32, 8, 2, 64) if args.small else (2048, 1408, 64, 6, 8192)
    net = Net(args.layers, H, F, E, K, T)
    Workspace(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=cuda)
    fwd = torch.compile(net) if args.compile else net
    gib = 2.0**30
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    rows = []
    for step in range(4):
        x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16 if cuda else torch.float32,
                        requires_grad=True)
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=cuda):
            y = fwd(x)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
        rows.append(torch.cuda.memory_allocated() / gib if cuda else 0.0)
    extra = rows[-1] - 3 * param_bytes / gib
    # Every live storage of at least min_bytes, once, named by the first tensor seen on it.
    min_bytes = 2**10 if args.small else 2**26
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    moments = {t.untyped_storage().data_ptr() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0}
    live = {}
    for o in gc.get_objects():
        try:
            if not isinstance(o, torch.Tensor) or o.device.type != DEV:
                continue
            st = o.untyped_storage()
            if st.nbytes() < min_bytes or st.data_ptr() in live:
                continue
        except Exception:  # noqa: BLE001 (objects gc lists need not be whole tensors)
            continue
        ptr = st.data_ptr()
        kind = "param" if ptr in params else "moment" if ptr in moments else "other"
        live[ptr] = (kind, tuple(o.shape), str(o.dtype), st.nbytes())
    groups = {}
    for kind, shape, dtype, nbytes in live.values():
        k = f"{kind} {shape} {dtype}"
        n, b = groups.get(k, (0, 0))
        groups[k] = (n + 1, b + nbytes)
    print(json.dumps(dict(compile=args.compile, allocated_after_zero_grad_gib=rows,
                          params_and_moments_gib=3 * param_bytes / gib, extra_gib=extra,
                          live_storages={k: dict(count=n, gib=round(b / gib, 6))
                                         for k, (n, b) in sorted(groups.items())}), indent=1))


if __name__ == "__main__":
    main()
