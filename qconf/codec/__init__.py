"""Codecs: quantization maps, scale types, rounding and dense packing -- the reference path --
and a codec's native form for the kernels (:mod:`qconf.codec.native`)."""
from .codec import ROUNDING_MODES, Codec, QTensor
from .qmap import MAP_NAMES, create_qmap
from .scales import SCALE_TYPES

__all__ = ["Codec", "QTensor", "create_qmap", "MAP_NAMES", "SCALE_TYPES", "ROUNDING_MODES"]
