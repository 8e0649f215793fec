"""BitNet b1.58 training through qconf's codecs (docs/bitnet.md).

Modules: ``bitlinear`` (the layer and its autograd function).
"""
from .bitlinear import BitLinear, bit_linear

__all__ = ["BitLinear", "bit_linear"]
