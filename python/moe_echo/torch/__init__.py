"""MoE Echo for PyTorch: the ``MoE`` module, its custom ops, and Hugging Face weight loading."""

from moe_echo.torch._ops import hold_clone_grads
from moe_echo.torch.hf import export_hf_moe, load_hf_moe
from moe_echo.torch.module import MoE

__all__ = ["MoE", "hold_clone_grads", "load_hf_moe", "export_hf_moe"]
