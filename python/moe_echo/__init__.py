"""MoE Echo: a dropless Mixture-of-Experts layer with expert parallelism and ECHO load balancing.

``moe_echo.torch.MoE`` is the PyTorch module (it needs torch); this top level needs only the
compiled extension. ``moe_config_fields()`` and ``echo_config_fields()`` list the C++ layer's
config fields (name, type, default, allowed, choices, help), which are ``MoE``'s keywords.
"""

from moe_echo._ext import cuda_available, echo_config_fields, moe_config_fields, version

__version__ = version()

__all__ = ["cuda_available", "moe_config_fields", "echo_config_fields", "__version__"]
