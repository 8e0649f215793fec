"""Choosing modules of a model by qualified name, with the qconfig's selector language (globs, or
``re:<regex>`` matched against the whole name; :func:`qconf.config.rules.compile_match`), and
replacing them in place.

:func:`select_modules` is shared by :func:`qconf.nn.quantize_` and the surgery helpers. It only
reads the model; every problem it finds is raised together, before anything is replaced, so a
failed call leaves the model as it was. Rules, for a list of ``modules`` patterns and ``exclude``
patterns:

* a module is *matched* by a pattern when the pattern matches one of its qualified names
  (``layers.0.fc1``; a module registered under several names has them all) and no ``exclude``
  pattern matches that name; the root module (name ``""``) is never selected;
* a pattern with no glob character (``*?[``, and not ``re:``) *names* a module: that module must
  exist, not be excluded and be of the wanted kind;
* every pattern must match at least one module of the wanted kind (one that selects nothing is a
  typo or a wrong model);
* a wildcard pattern skips the modules it matches that are not of the wanted kind.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from torch import nn

from ..config.rules import Reporter, check_match, compile_match

__all__ = ["Selected", "select_modules", "replace_module", "as_patterns", "module_names"]

_GLOB_CHARS = "*?["


@dataclasses.dataclass
class Selected:
    """A selected module and every qualified name it is registered under (the first is its name)."""

    module: nn.Module
    names: list[str]

    @property
    def name(self) -> str:
        return self.names[0]


def as_patterns(patterns: str | Sequence[str], what: str) -> tuple[str, ...]:
    """One pattern or a sequence of them, each checked like a qconfig ``match`` (``QConfigError``
    naming ``what[i]`` on a bad one)."""
    items = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    rep = Reporter(f"<{what}>")
    for i, p in enumerate(items):
        check_match(p, f"{what}[{i}]", rep)
    rep.raise_if_any()
    return items


def module_names(model: nn.Module) -> dict[int, Selected]:
    """Every submodule (the root excluded) by ``id``, with all the names it is registered under."""
    out: dict[int, Selected] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            out.setdefault(id(module), Selected(module, [])).names.append(name)
    return out


def _explicit(pattern: str) -> bool:
    return not pattern.startswith("re:") and not any(c in pattern for c in _GLOB_CHARS)


def select_modules(model: nn.Module, modules: Sequence[str], exclude: Sequence[str], *,
                   wanted: Callable[[nn.Module], bool], kind: str,
                   refuse: Callable[[nn.Module], str | None] = lambda m: None,
                   where: str = "modules", where_exclude: str = "exclude") -> list[Selected]:
    """The modules of ``model`` the patterns select that satisfy ``wanted`` (in ``named_modules``
    order), or ``ValueError`` listing every problem (see the module docstring). ``kind`` names
    the wanted modules in messages (``"nn.Linear"``); ``refuse(module)`` returns why a matched,
    not excluded module must not be selected at all (even by a wildcard), or None;
    ``where``/``where_exclude`` name the pattern lists in messages (``"bitnet.modules"``)."""
    mods = list(map(compile_match, modules))
    excl = list(map(compile_match, exclude))
    entries = module_names(model)
    problems: list[str] = []
    chosen: dict[int, Selected] = {}
    for i, (pattern, regex) in enumerate(zip(modules, mods)):
        label = f"{where}[{i}] {pattern!r}"
        hits = [(e, n) for e in entries.values() for n in e.names if regex.fullmatch(n)]
        kept = [(e, n) for e, n in hits if not any(x.fullmatch(n) for x in excl)]
        refused = [f"{label}: module {n!r} {why}" for e, n in kept for why in [refuse(e.module)] if why]
        if refused:
            problems.extend(refused)
            continue
        if _explicit(pattern):
            if not hits:
                problems.append(f"{label}: the model has no module named {pattern!r}")
                continue
            if not kept:
                problems.append(f"{label}: module {pattern!r} is excluded by {where_exclude}; remove one of them")
                continue
            e = kept[0][0]
            if not wanted(e.module):
                problems.append(f"{label}: module {pattern!r} is a {type(e.module).__name__} (wanted: {kind})")
                continue
        good = [(e, n) for e, n in kept if wanted(e.module)]
        if not good:
            seen = ", ".join(sorted({f"{n} ({type(e.module).__name__})" for e, n in kept})[:6]) or "none"
            problems.append(f"{label} selects no {kind} module (matched, not excluded: {seen})")
        for e, _ in good:
            chosen[id(e.module)] = e
    for e in chosen.values():
        left = [n for n in e.names if not any(r.fullmatch(n) for r in mods) or any(x.fullmatch(n) for x in excl)]
        if left:
            problems.append(f"module {e.name!r} is also registered as {', '.join(map(repr, left))}, which the "
                            f"patterns do not select: select all of its names or none")
    if problems:
        raise ValueError("\n".join(problems))
    return [e for key, e in entries.items() if key in chosen]


def replace_module(model: nn.Module, names: Sequence[str], new: nn.Module) -> None:
    """Register ``new`` under each qualified name in ``names`` (``a.b.c``: ``setattr(a.b, "c", new)``)."""
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
