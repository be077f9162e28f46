"""MoE Echo for PyTorch: the ``MoE`` module, the model-wide ``Workspace``, the custom ops, Hugging
Face weight loading, and torchtitan's MoE layers swapped for MoE Echo's."""

from moe_echo.torch._ops import hold_clone_grads
from moe_echo.torch.hf import HFMoE, export_hf_moe, load_hf_moe, swap_moe
from moe_echo.torch.module import MoE
from moe_echo.torch.titan import TitanMoE, swap_titan_moe
from moe_echo.torch.workspace import Workspace

__all__ = [
    "MoE", "Workspace", "hold_clone_grads", "load_hf_moe", "export_hf_moe", "swap_moe", "HFMoE",
    "swap_titan_moe", "TitanMoE",
]
