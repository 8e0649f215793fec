"""qconf: configurable quantization for low-bit optimizer states.

    cfg = qconf.load_config("configs/default.yml")     # YAML -> validated, frozen QConfig
    codec = qconf.Codec(bits=4, map="nonlinear", signed=True, scale="group", group_size=128)
    q = codec.encode(x); x_hat = codec.decode(q)       # reference path
"""
from .codec import Codec, QTensor, create_qmap
from .config import QConfig, StatePlan, load_config
from .memory import MemoryReport, memory_report
from .errors import QConfigError
from . import optim  # noqa: E402  (qconf.optim.AdamW after `import qconf`)
from . import nn  # noqa: E402  (qconf.nn.BitLinear, qconf.nn.quantize_ after `import qconf`)

__version__ = "0.1.0"

__all__ = ["Codec", "QTensor", "create_qmap", "QConfig", "StatePlan", "load_config", "QConfigError", "memory_report",
           "MemoryReport", "optim", "nn", "__version__"]
