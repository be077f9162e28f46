"""What torchtitan's trainer imports to run its MoE layers on MoE Echo: importing this module
registers the model converter ``"moe_echo"`` (``moe_echo.torch.titan.TitanConverter``), and its
``JobConfig`` adds the ``[moe_echo]`` section (``moe_echo.torch.titan.MoeEchoOptions``) to
torchtitan's job config. In a job's TOML file:

    [job]
    custom_config_module = "moe_echo.torch.titan_job"   # the [moe_echo] section; registers it

    [model]
    converters = ["moe_echo"]

    [moe_echo]
    recompute = "experts"      # MoE keywords: recompute, precision, overlap, ...; workspace

(``--experimental.custom_import moe_echo.torch.titan_job`` registers the converter alone, with the
default options.) See docs/stacks.md.
"""

from dataclasses import dataclass, field

from moe_echo.torch.titan import MoeEchoOptions, register_converter


@dataclass
class JobConfig:
    moe_echo: MoeEchoOptions = field(default_factory=MoeEchoOptions)


register_converter()
