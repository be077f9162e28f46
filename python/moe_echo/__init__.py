"""MoE Echo: a dropless Mixture-of-Experts layer with expert parallelism and ECHO load balancing.

``moe_echo.torch.MoE`` is the PyTorch module (it needs torch); this top level needs only the
compiled extension.
"""

from moe_echo._ext import cuda_available, version

__version__ = version()

__all__ = ["cuda_available", "__version__"]
