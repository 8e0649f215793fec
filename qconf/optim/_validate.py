"""Argument validation and small numeric helpers shared by the optimizers (messages match
torch.optim's).

Each optimizer's hyperparameters are checked by one function (:func:`adam_group`,
:func:`sgd_group`, :func:`lion_group`, :func:`muon_group`), called by its constructor and, through
:meth:`QOptimizer.validate_group`, by ``load_state_dict`` on every saved param group -- so a
checkpoint can hold only hyperparameters the constructor accepts. On top of torch.optim's range
checks they require real numbers (a one-element tensor where torch allows a tensor: ``lr``,
``betas``), finite values (a NaN or infinite lr, eps, weight decay, momentum or dampening only
ever produces NaN/inf parameters) and real booleans for flags. :func:`check_seed` is the one
rule for RNG seeds, of the constructor and of a checkpoint alike.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import torch

from ..codec import rng


def scalar(x: Any) -> float:
    """A Python float from a float or a one-element tensor (torch allows tensor lr)."""
    return x.item() if isinstance(x, torch.Tensor) else float(x)


def _real(what: str, value: Any, tensor_ok: bool = False) -> float:
    """``value`` as a float: a real number (not a bool), or a one-element real tensor where
    ``tensor_ok``; ``what`` is the message prefix naming it."""
    if tensor_ok and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {what} must be 1-element")
        if not value.is_floating_point():
            raise ValueError(f"Tensor {what} must be a floating tensor, got dtype {value.dtype}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kinds = "a real number or a one-element tensor" if tensor_ok else "a real number"
        raise ValueError(f"{what} must be {kinds}, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError) as e:
        raise ValueError(f"{what} must be a finite real number, got {value!r}") from e


def _finite(x: float, message: str) -> float:
    if not math.isfinite(x):
        raise ValueError(f"{message} (must be finite)")
    return x


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_seed(what: str, seed: Any, none_ok: bool = False) -> int | None:
    """An RNG seed checked: a Python int (not a bool) in [0, 2**64), or None where ``none_ok``;
    returned unchanged. The constructor's ``seed`` and a checkpoint's ``qconf.seed`` both follow
    this rule; ``what`` names the value in the ``ValueError``."""
    if none_ok and seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= rng.MASK64:
        allowed = "None (torch.initial_seed()) or an int" if none_ok else "an int"
        raise ValueError(f"{what} must be {allowed} in [0, 2**64), got {seed!r}")
    return seed


def check_lr(lr: Any) -> None:
    """torch's learning-rate check (a non-negative number or one-element tensor), finite."""
    x = _real("lr", lr, tensor_ok=True)
    if not 0.0 <= x:
        raise ValueError(f"Invalid learning rate: {lr}")
    _finite(x, f"Invalid learning rate: {lr}")


def _stored(value: Any, x: float) -> Any:
    """What a group keeps for a checked number: the value as given when it is a Python int or
    float (as torch keeps it), else its float (a numpy scalar, a Fraction, ...)."""
    return value if type(value) in (int, float) else x


def _non_negative(what: str, value: Any) -> float:
    """A finite number >= 0 (torch's ``Invalid <what> value`` message)."""
    x = _real(what, value)
    if not 0.0 <= x:
        raise ValueError(f"Invalid {what} value: {value}")
    return _finite(x, f"Invalid {what} value: {value}")


def _lr(lr: Any) -> Any:
    """The checked learning rate as a group keeps it (a one-element tensor stays a tensor)."""
    check_lr(lr)
    return lr if isinstance(lr, torch.Tensor) else _stored(lr, float(lr))


def _betas(betas: Any) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")  # torch.optim's rule
    out = []
    for i, b in enumerate(betas):
        x = _real(f"beta parameter at index {i}", b, tensor_ok=True)
        if not 0.0 <= x < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        out.append(x)
    return out[0], out[1]


def adam_group(group: Mapping[str, Any], name: str, decoupled: bool) -> dict[str, Any]:
    """Adam/AdamW (``decoupled``) hyperparameters of one group, checked as torch.optim.Adam does;
    torch-only keys, when present, must ask for what qconf implements. Returns the
    hyperparameters with ``betas`` as a tuple of floats."""
    lr = _lr(group["lr"])
    eps = _non_negative("epsilon", group["eps"])
    betas = _betas(group["betas"])
    wd = _non_negative("weight_decay", group["weight_decay"])
    _refuse_torch_options(name, group)
    if _flag("decoupled_weight_decay", group.get("decoupled_weight_decay", decoupled)) != decoupled:
        other = "AdamW" if group["decoupled_weight_decay"] else "Adam"
        raise ValueError(f"{name}: decoupled_weight_decay={group['decoupled_weight_decay']!r} is not supported; "
                         f"use qconf.optim.{other}")
    return {"lr": lr, "betas": betas, "eps": _stored(group["eps"], eps),
            "weight_decay": _stored(group["weight_decay"], wd), "maximize": _flag("maximize", group["maximize"]),
            "factor_second_moment": _flag("factor_second_moment", group["factor_second_moment"])}


def sgd_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """SGD hyperparameters of one group, checked as torch.optim.SGD does (plus a finite
    dampening); returns them."""
    lr = _lr(group["lr"])
    momentum = _non_negative("momentum", group["momentum"])
    wd = _non_negative("weight_decay", group["weight_decay"])
    dampening = _finite(_real("dampening", group["dampening"]), f"Invalid dampening value: {group['dampening']}")
    nesterov = _flag("nesterov", group["nesterov"])
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    _refuse_torch_options("SGD", group)
    return {"lr": lr, "momentum": _stored(group["momentum"], momentum),
            "dampening": _stored(group["dampening"], dampening), "weight_decay": _stored(group["weight_decay"], wd),
            "nesterov": nesterov, "maximize": _flag("maximize", group["maximize"])}


def lion_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """Lion hyperparameters of one group (lr, betas in [0, 1), weight decay); returns them with
    ``betas`` as a tuple of floats."""
    lr = _lr(group["lr"])
    betas = _betas(group["betas"])
    wd = _non_negative("weight_decay", group["weight_decay"])
    return {"lr": lr, "betas": betas, "weight_decay": _stored(group["weight_decay"], wd),
            "maximize": _flag("maximize", group["maximize"])}


#: torch.optim.Muon refuses ns_steps >= 100 ("for computational efficiency")
MAX_NS_STEPS = 99


def muon_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """Muon hyperparameters of one group, checked as torch.optim.Muon does (lr, momentum and
    weight decay >= 0, adjust_lr_fn None/"original"/"match_rms_adamw", three coefficients,
    ns_steps < 100), plus finite values, a finite eps >= 0 and a whole ns_steps >= 0; returns them
    with ``ns_coefficients`` as a tuple of floats."""
    lr = _lr(group["lr"])
    momentum = _non_negative("momentum", group["momentum"])
    wd = _non_negative("weight_decay", group["weight_decay"])
    eps = _non_negative("epsilon", group["eps"])
    coefficients = group["ns_coefficients"]
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must be a tuple of exactly 3 values (a, b, c), got {coefficients!r}")
    abc = tuple(_finite(_real(f"ns_coefficients[{i}]", c), f"Invalid ns_coefficients[{i}]: {c}")
                for i, c in enumerate(coefficients))
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_NS_STEPS:
        raise ValueError(f"ns_steps must be a whole number in [0, {MAX_NS_STEPS}] (torch.optim.Muon refuses 100 "
                         f"and more), got {steps!r}")
    fn = group["adjust_lr_fn"]
    if fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"Adjust learning rate function {fn!r} is not supported; use None, 'original' or "
                         "'match_rms_adamw'")
    return {"lr": lr, "weight_decay": _stored(group["weight_decay"], wd),
            "momentum": _stored(group["momentum"], momentum), "nesterov": _flag("nesterov", group["nesterov"]),
            "ns_coefficients": abc, "eps": _stored(group["eps"], eps), "ns_steps": steps, "adjust_lr_fn": fn}


def _refuse_torch_options(name: str, group: Mapping[str, Any]) -> None:
    """torch.optim's flags for what qconf does not implement (present in torch's checkpoints and
    accepted by the constructors) must be False."""
    flags = {k: _flag(k, group[k]) for k in ("amsgrad", "capturable", "differentiable") if k in group}
    refuse_unsupported(name, **flags)


def refuse_unsupported(name: str, *, amsgrad: Any = False, capturable: Any = False,
                       differentiable: Any = False) -> None:
    """Options of torch.optim that qconf does not implement get a clear error, never a silent no-op."""
    if amsgrad:
        raise ValueError(f"{name}: amsgrad=True is not supported (its max_exp_avg_sq state would need a "
                         "codec of its own); use amsgrad=False")
    if capturable:
        raise ValueError(f"{name}: capturable=True (CUDA graph capture) is not supported; use capturable=False")
    if differentiable:
        raise ValueError(f"{name}: differentiable=True is not supported; use differentiable=False")


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (what the native kernels compute).

    torch's float32 ``sqrt`` on CPU is not always correctly rounded; the float64 square root
    rounded to float32 is (double rounding is innocuous for sqrt: 53 >= 2 * 24 + 2 bits). A
    float64 ``x`` (float64 parameters) gets its own correctly rounded float64 square root.
    """
    if x.dtype == torch.float64:
        return x.sqrt()
    return x.double().sqrt_().float()
