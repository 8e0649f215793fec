"""How a qconf optimizer sees its parameters: names and global indexes (the qconfig's
``overrides`` match names; the index keys ``state_dict`` and the random streams), the refusal of
duplicates and of dtypes no rule can update, and the real view and compute dtype that float64 and
complex parameters step in."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["NamedParams", "PARAM_DTYPES", "real_view", "compute_dtype"]

#: the parameter dtypes the optimizers update: torch.optim's floating-point and complex ones that
#: the rules step (float8 and complex32 would round every update away or cannot be stepped)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.complex128)


class NamedParams:
    """Mixin of :class:`~qconf.optim.base.QOptimizer` (before ``torch.optim.Optimizer`` in its
    bases): ``add_param_group`` with ``(name, tensor)`` pairs, and the index/name lookups. It
    resets ``_index_cache`` and bumps ``_layout_version`` when groups change."""

    _index_cache: Any
    _layout_version: int
    param_groups: list[dict[str, Any]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, also accepting ``(name, tensor)`` pairs on every torch >= 2.4;
        a group with a parameter listed twice or of a dtype outside :data:`PARAM_DTYPES` is refused
        (``ValueError``) before anything changes. The constructor adds its groups through it."""
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif params is not None and not isinstance(params, set):
            params = list(params)
        if params is not None and not isinstance(params, set):
            _refuse_duplicates(params, len(getattr(self, "param_groups", ())))
        if params and all(isinstance(x, tuple) and len(x) == 2 for x in params):
            param_group = dict(param_group)
            param_group["param_names"] = [str(n) for n, _ in params]
            param_group["params"] = [t for _, t in params]
        elif params is not None and not isinstance(params, set):
            param_group = dict(param_group, params=params)
        if isinstance(param_group.get("params"), list):
            self._refuse_dtypes(param_group)
        super().add_param_group(param_group)
        self._index_cache = None
        self._layout_version = getattr(self, "_layout_version", 0) + 1

    def _param_index(self) -> dict[int, int]:
        """id(param) -> global index (the order of ``state_dict``), rebuilt when groups change."""
        return self._indexed()[1]

    def _named_params(self) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
        """(name, param, group) for every parameter in state_dict order; unnamed params get ''."""
        return self._indexed()[2]

    def _indexed(self) -> tuple[int, dict[int, int], list[tuple[str, torch.Tensor, dict[str, Any]]]]:
        count = sum(len(g["params"]) for g in self.param_groups)
        if self._index_cache is None or self._index_cache[0] != count:
            index: dict[int, int] = {}
            named = []
            for g in self.param_groups:
                names = g.get("param_names") or [""] * len(g["params"])
                named.extend((n, p, g) for n, p in zip(names, g["params"]))
                for p in g["params"]:
                    index.setdefault(id(p), len(index))
            self._index_cache = (count, index, named)
        return self._index_cache

    def param_name(self, index: int) -> str:
        """The qualified name of parameter ``index`` ('' if the optimizer was given plain tensors)."""
        return self._named_params()[index][0]

    def _describe(self, index: int) -> str:
        return _describe(index, self.param_name(index))

    def _refuse_dtypes(self, param_group: dict[str, Any]) -> None:
        """Refuse (``ValueError``) a parameter of ``param_group`` whose dtype is not in
        :data:`PARAM_DTYPES`: torch.optim accepts integer and bool parameters, then fails at
        ``step`` or truncates every update to nothing."""
        groups = getattr(self, "param_groups", ())
        first = sum(len(g["params"]) for g in groups)
        names = list(param_group.get("param_names") or ())
        for i, p in enumerate(param_group["params"]):
            if isinstance(p, torch.Tensor) and p.dtype not in PARAM_DTYPES:
                where = _describe(first + i, names[i] if i < len(names) else "")
                allowed = ", ".join(str(d) for d in PARAM_DTYPES[:-1]) + f" or {PARAM_DTYPES[-1]}"
                raise ValueError(f"{type(self).__name__}: {where} of param group {len(groups)} has dtype {p.dtype}, "
                                 f"which cannot be optimized; parameters must be {allowed}")


def _describe(index: int, name: str) -> str:
    """How messages name parameter ``index`` (``name``: '' when the optimizer got plain tensors)."""
    return f"parameter {index} ({name!r})" if name else f"parameter {index}"


def _refuse_duplicates(params: list[Any], group_index: int) -> None:
    """torch.optim only warns about a parameter listed twice in a group (deprecated); it would be
    updated twice per step, so qconf refuses it."""
    seen: dict[int, int] = {}
    for i, x in enumerate(params):
        t = x[1] if isinstance(x, tuple) and len(x) == 2 else x
        if isinstance(t, torch.Tensor) and seen.setdefault(id(t), i) != i:
            raise ValueError(f"param group {group_index} lists the same parameter twice (positions {seen[id(t)]} "
                             f"and {i}); each parameter may appear once (torch.optim deprecates duplicates)")


def real_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or its ``view_as_real`` (shape ``t.shape + (2,)``) if it is complex."""
    return torch.view_as_real(t) if t.is_complex() else t


def compute_dtype(real: torch.Tensor) -> torch.dtype:
    """The dtype a (real) parameter's update is computed in: float64 stays float64, all else fp32."""
    return torch.float64 if real.dtype == torch.float64 else torch.float32
