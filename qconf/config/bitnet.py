"""The ``bitnet:`` section of a qconfig (:class:`BitNetConfig`): which ``nn.Linear`` modules
:func:`qconf.nn.quantize_` turns into BitNet b1.58 layers, and the two codecs those layers use.

    bitnet:
      enable: true
      modules: ["*"]                                   # globs or 're:<regex>' on qualified module names
      exclude: [lm_head, "*.lm_head", head, "*.head"]  # the default: output heads stay full precision
      weight_eps: 1.0e-5                               # floor of the weights' absmean scale
      activation_eps: 1.0e-5                           # floor of each row's absmax scale
      activation_bits: 8

A module is selected when one ``modules`` pattern matches its qualified name
(``layers.0.attn.q_proj``) and no ``exclude`` pattern does; patterns are the ``overrides``
selector language (:func:`~qconf.config.rules.compile_match`). The section merges through ``base``
key by key (a list replaces the inherited list). docs/bitnet.md has the layer, docs/config.md the
fields.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from ..codec import Codec
from .frozen import FrozenDict
from .rules import Reporter, Spec, compile_match, normalize_fields

__all__ = ["BitNetConfig", "BITNET_FIELDS", "DEFAULT_EXCLUDE"]

_FP32 = torch.finfo(torch.float32)
#: An eps is a codec's ``min_scale``: a normal fp32 number, so that ``1 / s`` stays finite.
_EPS = dict(lo=_FP32.tiny, hi=_FP32.max, note="> 0, a normal fp32 value")

#: Rules for the fields of ``bitnet``, in dataclass order.
BITNET_FIELDS: Mapping[str, Spec] = FrozenDict({
    "enable": Spec("bool"),
    "modules": Spec("selectors", lo=1),
    "exclude": Spec("selectors", lo=0),
    "weight_eps": Spec("float", **_EPS),
    "activation_eps": Spec("float", **_EPS),
    "activation_bits": Spec("int", 2, 8, note="8 is BitNet's int8"),
    "latent_dtype": Spec("enum", choices=("keep", "float32", "bfloat16"), noun="latent dtype"),
})

#: Output heads keep full precision (BitNet b1.58 quantizes the blocks' linear layers only).
#: Embeddings are not ``nn.Linear`` and are never converted.
DEFAULT_EXCLUDE: tuple[str, ...] = ("lm_head", "*.lm_head", "head", "*.head")


@dataclasses.dataclass(frozen=True)
class BitNetConfig:
    """BitNet b1.58 training of selected ``nn.Linear`` modules (docs/config.md, ``bitnet``).

    Args:
        enable: whether :func:`qconf.nn.quantize_` may convert anything (default false).
        modules: selectors of the modules to convert (at least one), default ``("*",)``.
        exclude: selectors of modules never converted, default :data:`DEFAULT_EXCLUDE`.
        weight_eps: floor of the per-tensor absmean scale of the ternary weights (> 0).
        activation_eps: floor of the per-row absmax scale of the activations (> 0).
        activation_bits: width of the activation levels, 2..8 (``2**(bits-1) - 1`` levels each
            side of zero: 127 at 8 bits).
        latent_dtype: the dtype :func:`qconf.nn.quantize_` gives the converted layers' latent
            ``weight``/``bias``: ``keep`` (the Linear's own, default), ``float32`` or ``bfloat16``
            (with ``weights: {rounding: stochastic}`` the optimizer rounds updates into them
            stochastically).

    Lists are stored as tuples; constructing validates like loading (``QConfigError``).
    """

    enable: bool = False
    modules: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    weight_eps: float = 1e-5
    activation_eps: float = 1e-5
    activation_bits: int = 8
    latent_dtype: str = "keep"

    def __post_init__(self) -> None:
        rep = Reporter("<BitNetConfig>")
        normalize_fields(self, BITNET_FIELDS, rep)
        rep.raise_if_any()
        object.__setattr__(self, "_modules_re", tuple(compile_match(p) for p in self.modules))
        object.__setattr__(self, "_exclude_re", tuple(compile_match(p) for p in self.exclude))

    def weight_codec(self) -> Codec:
        """Ternary absmean weights: 2-bit codes of {-1, 0, +1}, one fp32 scale
        ``max(mean|W|, weight_eps)`` per tensor, round half to even."""
        return Codec(bits=2, map="ternary", signed=True, scale="tensor", statistic="absmean",
                     rounding="nearest-even", min_scale=self.weight_eps)

    def activation_codec(self) -> Codec:
        """Per-row absmax activations on a 2-D ``[rows, features]`` tensor: signed integer levels
        ``-MRQ..MRQ`` (``MRQ = 2**(activation_bits-1) - 1``), one fp32 scale
        ``max(max|row|, activation_eps)`` per row, round half to even."""
        return Codec(bits=self.activation_bits, map="linear", signed=True, scale="dim0", statistic="absmax",
                     rounding="nearest-even", min_scale=self.activation_eps)

    def excluded(self, name: str) -> bool:
        """Whether an ``exclude`` pattern matches the qualified module name ``name``."""
        return any(r.fullmatch(name) is not None for r in self._exclude_re)

    def selects(self, name: str) -> bool:
        """Whether the module named ``name`` (qualified, e.g. ``layers.0.fc1``) is selected: a
        ``modules`` pattern matches it and no ``exclude`` pattern does. Ignores ``enable``."""
        return any(r.fullmatch(name) is not None for r in self._modules_re) and not self.excluded(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists for the selectors); ``BitNetConfig(**d)`` rebuilds it."""
        out = {name: getattr(self, name) for name in BITNET_FIELDS}
        out["modules"], out["exclude"] = list(self.modules), list(self.exclude)
        return out
