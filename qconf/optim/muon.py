"""Muon (momentum orthogonalized by Newton–Schulz), torch.optim.Muon's algorithm with a quantized
momentum (qconfig section ``exp_avg``), and qconf's AdamW for the parameters Muon is not for --
one optimizer for a whole model.

A Muon step of one matrix ``p`` (gradient ``g``, momentum ``b``), as torch 2.13 computes it::

    b = lerp(b, g, 1 - momentum)                      (buf.lerp_(grad, 1 - momentum))
    u = lerp(g, b, momentum) if nesterov else b
    O = NS(u)                                         (bf16 Newton–Schulz: qconf.optim.newton_schulz)
    p = p * (1 - lr * weight_decay)
    p = p - O * adjusted_lr(lr, adjust_lr_fn, p.shape)

Fused, the two elementwise parts are two calls of the native kernel around Newton–Schulz (rules
``muon_momentum`` and ``muon_update`` in csrc/include/qconf/element.h): the first decodes the
momentum, updates and re-encodes it and writes ``u`` in bf16 (Newton–Schulz's input dtype: the
rounding torch's ``.bfloat16()`` does); the second applies decay and step with the weights policy
(bf16 stochastic rounding, Kahan). The reference path does the same fp32 operations with torch
ops. Both step one matrix at a time, so a step holds one matrix's update, not the model's.

Which parameters take Muon and which AdamW: :mod:`qconf.optim.muon_routing`. Each param group is
one or the other (its ``use_muon`` key, as in Keller Jordan's ``MuonWithAuxAdam``), with its
own hyperparameters; ``param_groups``, ``state_dict``, schedulers and ``memory_report`` see one
optimizer.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ..codec import QTensor
from ._validate import adam_group, muon_group, scalar
from .adam import AdamW
from .base import QOptimizer
from .fused import FusedParam, run_one
from .muon_routing import ADAMW, MUON, Router, muon_refusal
from .newton_schulz import adjusted_lr, zeropower
from .params import compute_dtype
from .sharded import is_sharded
from .spec import Hyper, Slot, StateSpec
from .weights import LOW_PRECISION

__all__ = ["Muon", "MUON_KEYS", "ADAMW_DEFAULTS"]

#: the hyperparameters of a Muon group (torch.optim.Muon's)
MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
#: the AdamW part's defaults: torch.optim.AdamW's (``adamw=`` overrides any of them)
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "maximize": False,
                  "factor_second_moment": False}
_ADAMW = AdamW  # the AdamW part's rule: its methods run on this optimizer's AdamW groups
_MUON_ONLY = tuple(k for k in MUON_KEYS if k not in ADAMW_DEFAULTS)
_ADAMW_ONLY = tuple(k for k in ADAMW_DEFAULTS if k not in MUON_KEYS)
#: why a sharded matrix cannot take Muon here
_SHARDED = ("it is sharded (an FSDP2 DTensor): Newton–Schulz needs the whole matrix, which qconf does not gather; "
            "route it to 'adamw' (route={name: 'adamw'}) or train with DDP or ZeRO-1")


class Muon(QOptimizer):
    """Muon for the 2-D hidden matrices, qconf AdamW for the rest, in one optimizer.

    Args:
        params: ``model.named_parameters()`` (routed by shape and name:
            :mod:`qconf.optim.muon_routing`), tensors, or param groups; a group with ``use_muon``
            is all Muon (True) or all AdamW (False), one without it is split by the routing.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            torch.optim.Muon's arguments and defaults, for the Muon groups.
        adamw: the AdamW part's hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``maximize``, ``factor_second_moment``); defaults :data:`ADAMW_DEFAULTS`.
        route: ``{name pattern: "muon" | "adamw"}``, overriding the qconfig and the default routing.
        qconfig, fused, seed, bf16_stochastic_round, compensation, gradient_release: as every
            qconf optimizer (:class:`~qconf.optim.base.QOptimizer`); the momentum is the
            ``exp_avg`` section's state, the AdamW part keeps ``exp_avg`` and ``exp_avg_sq``.
    """

    kernel_rule = "adam"  # the AdamW groups' kernel; a Muon group's two calls name their rules
    decoupled_weight_decay = True  # (read by AdamW's methods on the AdamW groups)
    elementwise_rule = True  # (AdamW groups; Muon groups never take the elementwise reference step)
    qconf_only_group_keys = ("use_muon", "factor_second_moment")
    layout_variants = ({"factor_second_moment": False}, {"factor_second_moment": True})

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, *,
                 adamw: Mapping[str, Any] | None = None, route: Mapping[str, str] | None = None,
                 qconfig: Any = None, fused: bool | None = None, seed: int | None = None,
                 bf16_stochastic_round: bool = False, compensation: str | None = None,
                 gradient_release: bool = False) -> None:
        defaults = muon_group({"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                               "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps,
                               "adjust_lr_fn": adjust_lr_fn})
        self._adamw_defaults = _adamw_defaults(adamw)
        self._route = route
        self._router: Router | None = None  # built once the qconfig is loaded (first add_param_group)
        super().__init__(params, {**defaults, "use_muon": True}, qconfig=qconfig, fused=fused, seed=seed,
                         bf16_stochastic_round=bf16_stochastic_round, compensation=compensation,
                         gradient_release=gradient_release)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_adamw_defaults=self._adamw_defaults, _route=self._route)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._router = None

    # -- groups: routing and per-rule defaults ---------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``. A group with ``use_muon`` is added as one group of that
        rule (a Muon group's parameters must all be Muon-able); one without it is split by the
        routing into a Muon group and an AdamW group (either may be absent), its other keys given
        to each part whose rule has them."""
        if not isinstance(param_group, Mapping):
            raise TypeError(f"param group must be a dict, got {type(param_group).__name__}")
        if "use_muon" in param_group:
            self._add_rule_group(dict(param_group))
            return
        parts = self._split(param_group)
        for use_muon in (True, False):
            if parts[use_muon]:
                other = _ADAMW_ONLY if use_muon else _MUON_ONLY
                group = {k: v for k, v in param_group.items() if k not in other and k not in ("params", "param_names")}
                self._add_rule_group({**group, "params": parts[use_muon], "use_muon": use_muon})

    def _split(self, param_group: Mapping[str, Any]) -> dict[bool, list[Any]]:
        """The group's parameters (tensors or (name, tensor) pairs) by rule, in order."""
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        if params is None or isinstance(params, set):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            f"but got {type(params).__name__}")
        params = list(params)
        names = list(param_group.get("param_names") or ())
        router = self._routing()
        parts: dict[bool, list[Any]] = {True: [], False: []}
        for i, x in enumerate(params):
            name, p = (str(x[0]), x[1]) if isinstance(x, tuple) and len(x) == 2 else (names[i] if i < len(names) else "", x)
            if not isinstance(p, torch.Tensor):
                parts[False].append(x)  # torch's add_param_group names what is wrong with it
                continue
            rule = router.rule(name, p)
            why = muon_refusal(p) if rule == MUON else None  # (the default routing picks real matrices only)
            if why is not None:
                raise ValueError(f"Muon: parameter {name or i!r} is routed to Muon (by route= or the qconfig's "
                                 f"'optimizer' override) but {why}")
            parts[rule == MUON].append(x if isinstance(x, tuple) or not name else (name, p))
        return parts

    def _add_rule_group(self, group: dict[str, Any]) -> None:
        """One group of one rule: its defaults filled, checked, added (torch also fills in the
        Muon defaults; an AdamW group drops them again)."""
        use_muon = group["use_muon"]
        if not isinstance(use_muon, bool):
            raise ValueError(f"use_muon must be True or False, got {use_muon!r}")
        base = {k: self.defaults[k] for k in MUON_KEYS} if use_muon else self._adamw_defaults
        checked = self.validate_group({**base, **group})
        super().add_param_group({**group, **checked})
        added = self.param_groups[-1]
        if use_muon:
            first = sum(len(g["params"]) for g in self.param_groups[:-1])
            for i, p in enumerate(added["params"]):
                why = muon_refusal(p) or (_SHARDED if is_sharded(p) else None)
                if why is not None:
                    where = self._describe(first + i)
                    del self.param_groups[-1]
                    self._index_cache = None
                    raise ValueError(f"Muon: {where} of a use_muon=True group: {why}")
        else:
            for key in MUON_KEYS:
                if key not in ADAMW_DEFAULTS:
                    added.pop(key, None)

    def _routing(self) -> Router:
        if self._router is None:
            self._router = Router(self._route, self.qconfig)
        return self._router

    @classmethod
    def validate_group(cls, group: Mapping[str, Any]) -> dict[str, Any]:
        use_muon = group.get("use_muon", True)
        if not isinstance(use_muon, bool):
            raise ValueError(f"use_muon must be True or False, got {use_muon!r}")
        if use_muon:
            return {**muon_group(group), "use_muon": True}
        return {**adam_group(group, "Muon (AdamW part)", True), "use_muon": False}

    def routing(self) -> dict[str, str]:
        """``{parameter name (or index): "muon" | "adamw"}`` for every parameter, in state_dict order."""
        return {name or str(i): MUON if g["use_muon"] else ADAMW for i, (name, _, g) in enumerate(self._named_params())}

    def _parse_checkpoint(self, state_dict: Any) -> Any:
        """The base's parsing, after checking that every saved group has this optimizer's rule
        (a group saved as Muon loads into a Muon group only: the states differ)."""
        saved = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
        if isinstance(saved, list) and len(saved) == len(self.param_groups):
            for i, (group, live) in enumerate(zip(saved, self.param_groups)):
                rule = group.get("use_muon", live["use_muon"]) if isinstance(group, Mapping) else live["use_muon"]
                if rule != live["use_muon"]:
                    raise ValueError(f"load_state_dict: param group {i} was saved with use_muon={rule!r}, this "
                                     f"optimizer's has use_muon={live['use_muon']!r} (the parameters are routed "
                                     "differently); the optimizer was left unchanged")
        return super()._parse_checkpoint(state_dict)

    # -- the rule ----------------------------------------------------------------------------------
    def _state_specs(self, group: dict[str, Any], p: torch.Tensor) -> list[StateSpec]:
        if group.get("use_muon", True):
            return [StateSpec("momentum_buffer", "exp_avg", tuple(p.shape), Slot.FIRST)]
        return _ADAMW._state_specs(self, group, p)

    def _spec_signature(self, group: dict[str, Any]) -> tuple:
        return (group.get("use_muon", True), bool(group.get("factor_second_moment", False)))

    def _hyper(self, group: dict[str, Any]) -> Hyper:
        return _ADAMW._hyper(self, group)  # (AdamW groups; a Muon matrix's two calls: _muon_hypers)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], step: int,
                group: dict[str, Any], new: frozenset[str]) -> None:
        _ADAMW._update(self, p, grad, states, step, group, new)  # (AdamW groups only)

    # -- the step: Muon groups one matrix at a time ----------------------------------------------
    def _fused_step(self, group: dict[str, Any]) -> None:
        if group["use_muon"]:
            self._muon_group(group)
        else:
            super()._fused_step(group)

    def _reference_group(self, group: dict[str, Any]) -> None:
        if group["use_muon"]:
            self._muon_group(group)
        else:
            super()._reference_group(group)

    def _init_group(self, group: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
        if group["use_muon"]:  # under torch.compile: stepped outside the graph (_reference_group)
            return False, False, 0, 0, (self._layout_version, self._kernel.generation)
        return super()._init_group(group, tensors)

    def _step_one(self, p: torch.Tensor, index: int, group: dict[str, Any]) -> None:
        if group["use_muon"]:
            self._muon_param(p, index, group, self._kernel is not None and self._fusable(group))
        else:
            super()._step_one(p, index, group)

    def _sharded_step(self, groups: list[dict[str, Any]]) -> None:
        if any(g["use_muon"] for g in groups):
            raise RuntimeError(f"Muon: a parameter of a Muon group cannot step: {_SHARDED}")
        super()._sharded_step(groups)

    @torch._disable_dynamo
    def _muon_group(self, group: dict[str, Any]) -> None:
        """The Muon step of every matrix of ``group`` that has a gradient, one at a time."""
        fused = self._kernel is not None and self._fusable(group)
        index = self._param_index()
        for p in group["params"]:
            if p.grad is not None:
                self._muon_param(p, index[id(p)], group, fused)

    def _muon_param(self, p: torch.Tensor, index: int, group: dict[str, Any], fused: bool) -> None:
        """One matrix's Muon step (module docstring), on the kernel or the reference path."""
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        if is_sharded(p):
            raise RuntimeError(f"Muon: {self._describe(index)} cannot step: {_SHARDED}")
        self._ensure_state(p, index, group)  # the buffer starts at zeros, as torch's
        if fused:
            self._muon_fused(p, index, group)
        else:
            self._muon_reference(p, index, group)

    def _muon_hypers(self, group: dict[str, Any], p: torch.Tensor) -> tuple[Hyper, Hyper]:
        """The two kernel calls' hyperparameters: the momentum's, the update's."""
        lr = scalar(group["lr"])
        momentum = Hyper(lr=lr, momentum=group["momentum"], nesterov=group["nesterov"])
        update = Hyper(lr=lr, weight_decay=group["weight_decay"],
                       adjusted_lr=adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return momentum, update

    def _muon_fused(self, p: torch.Tensor, index: int, group: dict[str, Any]) -> None:
        state, plan = self.state[p], self.plan(index)
        before = state["step"].clone()  # the update call advances its own counter to the same step
        h_momentum, h_update = self._muon_hypers(group, p)
        u = torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)
        run_one("muon_momentum", FusedParam(index, u, state["step"], {Slot.FIRST: state["momentum_buffer"]}),
                p.grad, h_momentum, self._seed)
        o = zeropower(u, group["ns_coefficients"], group["ns_steps"], group["eps"])
        del u
        comp = {Slot.COMPENSATION: state["kahan_comp"]} if "kahan_comp" in state else {}
        run_one("muon_update", FusedParam(index, p, before, comp, stochastic_weights=plan.weights.rounding == "stochastic"),
                o, h_update, self._seed)

    def _muon_reference(self, p: torch.Tensor, index: int, group: dict[str, Any]) -> None:
        """The reference Muon step of one matrix: torch.optim.Muon's own operations in fp32
        (``torch.lerp`` and ``add_(alpha=)``, fused multiply-adds in torch's CPU kernels, as the
        native rules compute them), on the decoded momentum."""
        state, plan = self.state[p], self.plan(index)
        state["step"] += 1
        step = int(state["step"].item())
        momentum = group["momentum"]
        buf = state["momentum_buffer"]
        dtype = compute_dtype(p)  # float64 parameters keep float64 (as their momentum), all else fp32
        b = buf.decode().to(dtype) if isinstance(buf, QTensor) else buf
        g = p.grad.to(dtype)
        b.lerp_(g, 1 - momentum)
        u = g.lerp(b, momentum) if group["nesterov"] else b
        o = zeropower(u.bfloat16(), group["ns_coefficients"], group["ns_steps"], group["eps"])
        if isinstance(buf, QTensor):
            self._store(state, "momentum_buffer", "exp_avg", b, step, index, None, [])
        del u, b, g
        lr = scalar(group["lr"])
        low = p.dtype in LOW_PRECISION
        p32 = p.float() if low else p
        p_old = p.float() if low and "kahan_comp" in state else None
        p32.mul_(1 - lr * group["weight_decay"])
        p32.add_(o, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        if low:
            p.copy_(self._write_param(p, p32, p_old, state, index, step, plan, None, []))


def _adamw_defaults(adamw: Mapping[str, Any] | None) -> dict[str, Any]:
    """The AdamW part's defaults: :data:`ADAMW_DEFAULTS` with ``adamw``'s keys, checked."""
    if adamw is None:
        adamw = {}
    if not isinstance(adamw, Mapping):
        raise ValueError(f"adamw must be a dict of AdamW hyperparameters, got {type(adamw).__name__}")
    unknown = sorted(set(adamw) - set(ADAMW_DEFAULTS))
    if unknown:
        raise ValueError(f"adamw: unknown key(s) {unknown}; the AdamW part takes {sorted(ADAMW_DEFAULTS)}")
    return adam_group({**ADAMW_DEFAULTS, **adamw}, "Muon (AdamW part)", True)
