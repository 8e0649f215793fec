"""Which parameters :class:`qconf.optim.Muon` steps with Muon and which with its AdamW part.

Muon is for the 2-D hidden matrices of a network; embeddings, the output head, norms and biases
take AdamW (torch.optim.Muon's documentation pairs it with AdamW for those). A parameter's rule,
the first that applies:

1. the constructor's ``route`` (``{pattern: "muon" | "adamw"}``, patterns as the qconfig's
   ``match``: an fnmatch glob on the qualified name, or ``re:<regex>``; the last matching wins);
2. the qconfig: the last override that matches it and sets ``optimizer`` (docs/config.md);
3. by shape and name: a real, non-empty 2-D parameter whose name matches none of
   :data:`DEFAULT_ADAMW_NAMES` (embeddings, output heads) takes Muon; everything else AdamW.

A parameter routed to Muon explicitly that Muon cannot step (not 2-D, complex) is refused with a
``ValueError`` naming it -- never reshaped or stepped some other way in silence.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from ..config import QConfig
from ..config.rules import compile_match

__all__ = ["MUON", "ADAMW", "DEFAULT_ADAMW_NAMES", "Router", "muon_refusal"]

MUON, ADAMW = "muon", "adamw"
#: 2-D parameters that are not hidden matrices, by qualified name (GPT-2/HF/nanoGPT/Llama names of
#: token and position embeddings and output heads); they take AdamW unless routed explicitly
DEFAULT_ADAMW_NAMES = ("*embed*", "*emb.*", "*wte.*", "*wpe.*", "*lm_head.*", "head.*", "*.head.*", "output.weight",
                       "classifier.*", "*.classifier.*")
_DEFAULTS = tuple(compile_match(p) for p in DEFAULT_ADAMW_NAMES)


class Router:
    """The rule of each parameter (module docstring). ``route``: the constructor's ``{pattern:
    "muon" | "adamw"}`` (checked here: ValueError naming a bad pattern or rule)."""

    def __init__(self, route: Mapping[str, str] | None, qconfig: QConfig):
        if route is None:
            route = {}
        if not isinstance(route, Mapping):
            raise ValueError(f"route must be a dict {{pattern: 'muon' | 'adamw'}}, got {type(route).__name__}")
        self.route: dict[str, str] = {}
        self._compiled: list[tuple[re.Pattern[str], str]] = []
        for pattern, rule in route.items():
            if not isinstance(pattern, str) or rule not in (MUON, ADAMW):
                raise ValueError(f"route: {pattern!r}: {rule!r} -- a route maps a name pattern (an fnmatch glob on "
                                 "the qualified name, or 're:<regex>') to 'muon' or 'adamw'")
            try:
                self._compiled.append((compile_match(pattern), rule))
            except re.error as e:
                raise ValueError(f"route: {pattern!r} is not a valid regex ({e})") from None
            self.route[pattern] = rule
        self.qconfig = qconfig

    def rule(self, name: str, p: torch.Tensor) -> str:
        """The rule (:data:`MUON` or :data:`ADAMW`) of parameter ``name``: the constructor's
        route, else the qconfig's, else shape and name (which give Muon real matrices only)."""
        chosen = None
        for regex, rule in self._compiled:
            if regex.fullmatch(name):
                chosen = rule
        if chosen is None:
            chosen = self.qconfig.optimizer_route(name, tuple(p.shape))
        if chosen is not None:
            return chosen
        if muon_refusal(p) is not None or any(r.fullmatch(name) for r in _DEFAULTS):
            return ADAMW
        return MUON


def muon_refusal(p: Any) -> str | None:
    """Why Muon cannot step ``p`` (None if it can): Newton–Schulz orthogonalizes a real matrix."""
    if not isinstance(p, torch.Tensor):
        return f"it is a {type(p).__name__}, not a tensor"
    if p.is_complex():
        return f"it is complex ({p.dtype}); Muon steps real matrices"
    if p.dim() != 2:
        return (f"it has shape {tuple(p.shape)}; Muon steps 2-D matrices (route it to 'adamw', or reshape it into "
                "a matrix in the model)")
    if p.numel() == 0:
        return f"it is empty (shape {tuple(p.shape)}): there is no matrix to orthogonalize"
    return None
