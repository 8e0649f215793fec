"""Codecs: quantization maps, scale types and statistics, rounding (BitNet's integer levels
included: :mod:`qconf.codec.integer`) and dense packing -- the reference path --
and a codec's native form for the kernels (:mod:`qconf.codec.native`)."""
from .codec import INTEGER_ROUNDING_MODES, ROUNDING_MODES, Codec, QTensor
from .qmap import MAP_NAMES, create_qmap
from .scales import SCALE_TYPES, STATISTICS

__all__ = ["Codec", "QTensor", "create_qmap", "MAP_NAMES", "SCALE_TYPES", "ROUNDING_MODES", "INTEGER_ROUNDING_MODES",
           "STATISTICS"]
