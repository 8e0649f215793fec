"""Export of a BitNet-trained model with 2-bit packed ternary weights, and inference from it.

``export_bitnet(model)`` returns plain data (``torch.save`` it; ``torch.load(weights_only=True)``
reads it back)::

    {"format": "qconf.bitnet", "version": 1,
     "layers": {name: {"weight": {"codes": uint8 [ceil(N*K/4)], "scales": fp32 [1],
                                  "shape": [N, K], "codec": {...}},      # QTensor.to_dict()
                       "activation_codec": {...}}},                      # Codec.to_dict()
     "state": {key: tensor}}   # every other state-dict entry, BitLinear biases included, as is

``load_bitnet(model, exported)`` turns the BitLinear modules of a model of the same architecture
(e.g. built and converted the same way) into :class:`BitLinearInference` layers holding the packed
codes, and loads everything else; their forward equals the training forward bit for bit on the
same input. :func:`bitnet_sizes` counts the bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
from torch import nn

from .._table import format_table
from ..codec import Codec, QTensor
from .bitlinear import BitLinear, quantized_forward
from .select import module_names, replace_module

__all__ = ["BitLinearInference", "export_bitnet", "load_bitnet", "bitnet_sizes", "BitNetSizes", "FORMAT"]

FORMAT, VERSION = "qconf.bitnet", 1


class BitLinearInference(nn.Module):
    """Inference form of a trained :class:`BitLinear`: buffers ``weight_codes`` (uint8, the 2-bit
    packed ternary codes, ``ceil(out*in/4)`` bytes), ``weight_scale`` (fp32 ``[1]``) and ``bias``
    (``[out]`` or None). Input ``[..., in_features]`` -> ``[..., out_features]``, the same bits as
    the training forward (:func:`qconf.nn.bitlinear.quantized_forward`); no gradients."""

    def __init__(self, weight: QTensor, activation_codec: Codec, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = (int(n) for n in weight.shape)
        self.weight_codec, self.activation_codec = weight.codec, activation_codec
        self.register_buffer("weight_codes", weight.codes)
        self.register_buffer("weight_scale", weight.scales)
        self.register_buffer("bias", bias)

    def weight_qtensor(self) -> QTensor:
        """The packed weights as a :class:`~qconf.codec.QTensor` (``.decode()``: fp32 ``[out, in]``)."""
        return QTensor(self.weight_codes, self.weight_scale, torch.Size((self.out_features, self.in_features)),
                       self.weight_codec)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        levels = self.weight_codec.decode_levels(self.weight_qtensor())
        return quantized_forward(x, levels, self.weight_scale, self.bias, self.weight_codec, self.activation_codec)[0]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _same_tensor(t: torch.Tensor) -> tuple[Any, ...]:
    """A key equal for tensors that are the same data (one tensor, or views alike of one storage,
    as tied weights come back from ``torch.load``)."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def _snapshot(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies of ``state``; entries sharing one tensor (tied weights) share one copy."""
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    out = {}
    for key, t in state.items():
        ident = _same_tensor(t)
        if ident not in copies:
            copies[ident] = t.detach().clone()
        out[key] = copies[ident]
    return out


def export_bitnet(model: nn.Module) -> dict[str, Any]:
    """The model with each :class:`BitLinear`'s weight packed to 2-bit ternary codes and its
    scale (``weight_codec.encode``; the levels the forward uses), everything else as in its
    ``state_dict()`` (copied). Format: module docstring. ``ValueError`` if it has no BitLinear."""
    layers, packed_keys = {}, set()
    for entry in module_names(model).values():
        m = entry.module
        if isinstance(m, BitLinear):
            q = m.weight_codec.encode(m.weight.detach())
            layers[entry.name] = {"weight": q.to_dict(), "activation_codec": m.activation_codec.to_dict()}
            packed_keys.update(f"{n}.weight" for n in entry.names)
    if not layers:
        raise ValueError("export_bitnet: the model has no BitLinear (convert it with qconf.nn.quantize_ first)")
    state = {k: v for k, v in model.state_dict().items() if k not in packed_keys}
    return {"format": FORMAT, "version": VERSION, "layers": layers, "state": _snapshot(state)}


def _read_layers(model: nn.Module, exported: Any) -> tuple[dict[str, Any], list[str]]:
    """(name -> (entry, new BitLinearInference)) for ``load_bitnet``, and the problems found."""
    problems: list[str] = []
    if not isinstance(exported, Mapping) or exported.get("format") != FORMAT or exported.get("version") != VERSION \
            or not isinstance(exported.get("layers"), Mapping) or not isinstance(exported.get("state"), Mapping):
        return {}, [f"not a {FORMAT} version {VERSION} export (a dict from qconf.nn.export_bitnet)"]
    bitlinears = {e.name: e for e in module_names(model).values() if isinstance(e.module, BitLinear)}
    layers = exported["layers"]
    missing, extra = sorted(set(bitlinears) - set(layers)), sorted(set(layers) - set(bitlinears))
    if missing:
        problems.append(f"BitLinear modules with no exported weights: {', '.join(missing)}")
    if extra:
        problems.append(f"exported layers that are not BitLinear modules of the model: {', '.join(extra)}")
    state = exported["state"]
    out = {}
    for name in sorted(set(bitlinears) & set(layers)):
        entry, m = bitlinears[name], bitlinears[name].module
        try:
            q = QTensor.from_dict(layers[name]["weight"])
            q.codec.decode_levels(q)  # an integer-grid codec whose codes unpack to levels
            act = Codec.from_dict(layers[name]["activation_codec"])
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"layer {name!r}: {e}")
            continue
        if tuple(q.shape) != tuple(m.weight.shape):
            problems.append(f"layer {name!r}: exported weight shape {tuple(q.shape)}, model {tuple(m.weight.shape)}")
            continue
        bias = state.get(f"{name}.bias") if m.bias is not None else None
        out[name] = (entry, BitLinearInference(q, act, None if bias is None else bias.clone()))
    return out, problems


def load_bitnet(model: nn.Module, exported: Mapping[str, Any]) -> list[str]:
    """Turn the :class:`BitLinear` modules of ``model`` into :class:`BitLinearInference` layers
    with the exported packed weights, and load every other exported tensor into the model
    (``load_state_dict``, strict). ``model`` has the exporting model's architecture, converted
    the same way (the same BitLinear names and shapes).

    Returns the names of the replaced layers. Raises ``ValueError`` listing every mismatch
    (missing or extra layers, shapes, state keys); on error the model is left unchanged.
    """
    layers, problems = _read_layers(model, exported)
    state = dict(exported["state"]) if not problems else {}
    if not problems:
        own = model.state_dict()
        weights = {f"{n}.weight" for entry, _ in layers.values() for n in entry.names}
        want = {k: v for k, v in own.items() if k not in weights}
        missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
        problems += [f"missing state entries: {', '.join(missing)}"] if missing else []
        problems += [f"unexpected state entries: {', '.join(extra)}"] if extra else []
        problems += [f"state entry {k!r}: exported shape {tuple(state[k].shape)}, model {tuple(v.shape)}"
                     for k, v in want.items() if k in state and state[k].shape != v.shape]
    if problems:
        raise ValueError("load_bitnet: " + "\n".join(problems))
    for entry, new in layers.values():
        replace_module(model, entry.names, new)
        for n in entry.names:
            state[f"{n}.weight_codes"], state[f"{n}.weight_scale"] = new.weight_codes, new.weight_scale
    model.load_state_dict(state, strict=True)
    return sorted(layers)


@dataclasses.dataclass(frozen=True)
class BitNetSizes:
    """Bytes of an export: the BitLinear weights packed (codes + fp32 scales) vs as fp32 / bf16,
    and every other tensor (biases, norms, embeddings, excluded heads, buffers) as exported, and
    as fp32 / bf16 (non-floating tensors at their own size). ``numel`` counts elements."""

    linear_numel: int
    linear_packed_bytes: int
    other_numel: int
    other_bytes: int
    other_fp32_bytes: int
    other_bf16_bytes: int

    @property
    def packed_bytes(self) -> int:
        """The whole export: packed linear weights + the rest as exported."""
        return self.linear_packed_bytes + self.other_bytes

    def fp32_bytes(self, linear_only: bool = False) -> int:
        return 4 * self.linear_numel + (0 if linear_only else self.other_fp32_bytes)

    def bf16_bytes(self, linear_only: bool = False) -> int:
        return 2 * self.linear_numel + (0 if linear_only else self.other_bf16_bytes)

    def table(self) -> str:
        """A plain-text table: linear weights and whole model, packed / fp32 / bf16 bytes and ratios."""
        rows = []
        for label, packed, only in (("linear weights", self.linear_packed_bytes, True),
                                    ("whole model", self.packed_bytes, False)):
            f32, b16 = self.fp32_bytes(only), self.bf16_bytes(only)
            rows.append([label, packed, f32, b16, packed / f32 if f32 else None, packed / b16 if b16 else None])
        return format_table(["", "packed B", "fp32 B", "bf16 B", "packed/fp32", "packed/bf16"], rows,
                            float_format=".4f")


def bitnet_sizes(exported: Mapping[str, Any]) -> BitNetSizes:
    """:class:`BitNetSizes` of an :func:`export_bitnet` dict (tensors shared by several state
    entries, such as tied weights, are counted once)."""
    linear_numel = linear_bytes = 0
    for layer in exported["layers"].values():
        w = layer["weight"]
        linear_numel += int(torch.Size(w["shape"]).numel())
        linear_bytes += w["codes"].nbytes + w["scales"].nbytes
    unique = {_same_tensor(t): t for t in exported["state"].values()}.values()
    numel = sum(t.numel() for t in unique)
    as_is = sum(t.nbytes for t in unique)
    f32 = sum(t.numel() * 4 if t.is_floating_point() else t.nbytes for t in unique)
    b16 = sum(t.numel() * 2 if t.is_floating_point() else t.nbytes for t in unique)
    return BitNetSizes(linear_numel, linear_bytes, numel, as_is, f32, b16)
