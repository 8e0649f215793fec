"""Gradient release: each parameter steps inside backward, as soon as its gradient is accumulated,
and its gradient is freed at once -- so a training run never holds every gradient at the same time
(docs/memory.md).

``AdamW(..., gradient_release=True)`` (any qconf optimizer), then
:func:`prepare_gradient_release` ``(model, opt)`` registers, on every parameter of the optimizer,
a ``register_post_accumulate_grad_hook`` that runs that parameter's step (fused kernel or reference
path, the group's hyperparameters as they are at that moment) and replaces its ``.grad`` by a
:class:`ReleasedGrad`: a tensor of the gradient's shape, dtype and device with no storage. With
``prepare_gradient_release(..., grad_norms=True)`` it keeps the gradient's 2-norm (one more read of
each gradient), so norms of the gradients work (``clip_grad_norm_`` returns the true global norm,
to log it); anything else that would change or read the values raises a clear error (any
gradient norm without ``grad_norms=True``, a clip that would scale the gradients, an fp16
``GradScaler``, ``zero_grad(set_to_none=False)``: gradient release has already stepped on the
gradient as it was). A pre-hook on each parameter drops the marker before the next backward
accumulates.
While the hooks are in place ``opt.step()`` has nothing to do and ``opt.zero_grad()`` only drops the
markers (they act only on gradients that are still held, which a release loop has none of), so training loops,
LR schedulers, HF Trainer and Lightning run unchanged; :func:`remove_gradient_release` takes the
hooks off and the optimizer steps normally again.

Each parameter's step is the one the normal step gives it: step counters, bias corrections and
random streams are per parameter, so the order in which backward reaches the parameters cannot
change a bit. Gradient accumulation over micro-batches: ``with opt.no_release():`` around every
backward but the last of a batch (the gradients accumulate as usual; the last backward steps on
their sum). An ``opt.step()`` that finds a parameter stepped twice since the previous one -- a
framework accumulating micro-batches without ``no_release()`` -- is refused.

A closure passed to ``step`` runs once, as torch.optim runs it, and its backward steps the
parameters (Lightning passes forward + backward as a closure on every step). Refused, with what to
use instead: runs whose gradients are reduced across processes after accumulation (DDP, FSDP2: a
release step would see the unreduced gradient), detected at :func:`prepare_gradient_release` and
again in every hook before anything is stepped.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from .sharded import is_sharded

__all__ = ["ReleasedGrad", "ReleaseSteps", "prepare_gradient_release", "remove_gradient_release"]

#: the attribute of a prepared model that holds its hooks
_MODEL_ATTR = "_qconf_gradient_release"
#: what every refusal of a released gradient suggests
_INSTEAD = ("gradient release steps each parameter inside backward and frees its gradient, so nothing that changes "
            "gradients after backward can run (this step already used the gradient as it was): drop global-norm "
            "clipping (HF Trainer: max_grad_norm=0; Lightning: gradient_clip_val=None) and the fp16 GradScaler "
            "(bf16 autocast needs none), or train without gradient release "
            "(qconf.optim.remove_gradient_release(model))")


class ReleasedGrad(torch.Tensor):
    """The ``.grad`` of a parameter whose gradient release step has run: shape, dtype and device of
    the gradient, no storage, and -- when ``keep_norm`` -- the gradient's 2-norm (``norm2``, a 0-d
    tensor of the gradient's dtype, taken before it was freed; else None). What a framework asks of
    gradients after backward works where it needs only that: their 2-norms when kept
    (``torch.linalg.vector_norm`` / ``torch._foreach_norm``, so ``clip_grad_norm_`` returns the
    true global norm, to log it), and a multiplication by exactly 1 (a clip that clips nothing).
    Every other operation -- a norm that was not kept, a clip that would scale the gradients,
    GradScaler's unscale, ``zero_grad(set_to_none=False)`` -- raises a RuntimeError naming the
    parameter and the operation."""

    @staticmethod
    def __new__(cls, grad: torch.Tensor, name: str, keep_norm: bool) -> "ReleasedGrad":
        t = torch.Tensor._make_wrapper_subclass(cls, grad.shape, dtype=grad.dtype, device=grad.device,
                                                layout=grad.layout, requires_grad=False)
        t.param_name = name
        t.norm2 = torch.linalg.vector_norm(grad, 2.0) if keep_norm else None
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"ReleasedGrad({self.param_name}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        released = [a for a in _flat(args, kwargs) if isinstance(a, ReleasedGrad)]
        name = released[0].param_name if released else "a parameter"
        norm = ((func is torch.ops.aten.linalg_vector_norm.default or (func is torch.ops.aten._foreach_norm.Scalar and
                 all(isinstance(t, ReleasedGrad) for t in args[0]))) and _is_plain_2norm(args[1:], kwargs))
        if norm and any(t.norm2 is None for t in released):
            raise RuntimeError(f"{func}: gradient release kept no norm of the gradient of {name}; to log gradient "
                               "norms, prepare with qconf.optim.prepare_gradient_release(model, opt, grad_norms=True) "
                               "(one more read of every gradient). A global-norm clip that would scale the gradients "
                               "cannot work either way: HF Trainer max_grad_norm=0, Lightning gradient_clip_val=None")
        if norm:
            return args[0].norm2.clone() if isinstance(args[0], ReleasedGrad) else [t.norm2.clone() for t in args[0]]
        if func in (torch.ops.aten.mul_.Tensor, torch.ops.aten.mul_.Scalar) and _is_one(args[1]):
            return args[0]
        raise RuntimeError(f"{func} read the gradient of {name}, which gradient release already used for its step and "
                           f"freed; {_INSTEAD}")


def _is_plain_2norm(args: tuple, kwargs: dict) -> bool:
    """The arguments after the tensor(s) of a norm call ask for the plain 2-norm of everything."""
    ord_ = args[0] if args else kwargs.get("ord", 2.0)
    return float(ord_) == 2.0 and not args[1:] and all(kwargs.get(k) in (None, False) for k in ("dim", "keepdim", "dtype"))


def _is_one(x: Any) -> bool:
    """``x`` (a number or a one-element tensor) is exactly 1: multiplying by it changes nothing."""
    return bool(x == 1.0) if not isinstance(x, torch.Tensor) else x.numel() == 1 and bool(x.item() == 1.0)


def _flat(args: tuple, kwargs: dict | None) -> Iterator[Any]:
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _multi_process_reason(params: list[torch.Tensor]) -> str | None:
    """Why gradients may be reduced across processes after accumulation (None if they are not)."""
    if any(is_sharded(p) for p in params):
        return "its parameters are sharded DTensors (FSDP2)"
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return f"torch.distributed runs {torch.distributed.get_world_size()} processes (DDP reduces gradients after " \
               "they are accumulated)"
    return None


def _refuse_multi_process(params: list[torch.Tensor]) -> None:
    reason = _multi_process_reason(params)
    if reason is not None:
        raise RuntimeError(f"gradient release is not supported here: {reason}; a parameter's step would run on its "
                           "local, unreduced gradient. Use the normal optimizer step in multi-process training "
                           "(construct the optimizer without gradient_release=True)")


class _Hooks:
    """What :func:`prepare_gradient_release` registered on one model (kept on the model)."""

    def __init__(self, opt: "ReleaseSteps", handles: list[Any]):
        self.opt = opt
        self.handles = handles


class ReleaseSteps:
    """Mixin of :class:`~qconf.optim.base.QOptimizer`: the per-parameter step of gradient release,
    ``step`` / ``zero_grad`` while it is active, and :meth:`no_release`. It uses the optimizer's
    ``_step_one`` (one parameter's step), ``_param_index``, ``_named_params`` and ``_describe``."""

    _gradient_release: bool
    _release_active: bool
    _release_paused: int
    _release_counts: dict[int, int]
    _release_norms: bool

    def _init_release(self, gradient_release: bool) -> None:
        if not isinstance(gradient_release, bool):
            raise ValueError(f"gradient_release must be True or False, got {gradient_release!r}")
        self._gradient_release = gradient_release
        self._reset_release()

    def _reset_release(self) -> None:
        """Not prepared (a copy or an unpickled optimizer starts so: the hooks belong to the model)."""
        self._release_active = False
        self._release_norms = False
        self._release_paused = 0
        self._release_counts = {}

    @property
    def gradient_release(self) -> bool:
        """Whether this optimizer was built for gradient release (``gradient_release=True``)."""
        return self._gradient_release

    @contextlib.contextmanager
    def no_release(self) -> Iterator[None]:
        """Within this context backward accumulates gradients without stepping (gradient
        accumulation over micro-batches: every backward of a batch but the last); the first
        backward after it steps each parameter on its accumulated gradient."""
        self._release_paused += 1
        try:
            yield
        finally:
            self._release_paused -= 1

    def _release_param(self, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook: step ``p`` alone on its gradient, then free the gradient."""
        if self._release_paused:
            return
        _refuse_multi_process([p])
        index = self._param_index()[id(p)]
        with torch.no_grad():
            self._step_one(p, index, self._named_params()[index][2])
        self._release_counts[index] = self._release_counts.get(index, 0) + 1
        p.grad = ReleasedGrad(p.grad, self._describe(index), self._release_norms)

    def _released_step(self, closure: Callable[[], Any] | None) -> Any:
        """``opt.step(closure=None)`` while the hooks are in place. A closure runs once, as in a
        normal step (Lightning's automatic optimization passes forward + backward as one): its
        backward steps the parameters. Then only gradients still held are stepped -- none in a
        release loop; those of backward passes inside :meth:`no_release` that no backward outside
        it followed; DCP's zero gradients when it creates the states. Refused: a parameter stepped
        more than once since the previous call (micro-batches accumulated without
        :meth:`no_release`). Returns the closure's loss (None without one)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        twice = {i: n for i, n in self._release_counts.items() if n > 1}
        self._release_counts = {}
        if twice:
            i = min(twice)
            n = twice[i]
            raise RuntimeError(f"{type(self).__name__}.step(): gradient release stepped {self._describe(i)} {n} times "
                               f"since the previous step() ({len(twice)} parameter(s) more than once): backward ran "
                               "several times per step, as in gradient accumulation over micro-batches, and every "
                               "backward took a step. Wrap every backward of a batch but the last in "
                               "`with opt.no_release():` (HF Trainer: gradient_accumulation_steps=1)")
        with torch.no_grad():
            for p, index, group in self._held_grads():
                self._step_one(p, index, group)
        return loss

    def _release_zero_grad(self, set_to_none: bool) -> None:
        """``opt.zero_grad()`` while the hooks are in place: the gradients still held (see
        :meth:`_released_step`) as torch's zero_grad treats them. ``set_to_none=True`` (torch's
        default) also drops the markers, so no ``.grad`` is left, as torch users expect; with
        ``set_to_none=False`` they stay (zeroing one would read a gradient that is gone) and the
        next backward drops them."""
        for _, p, _ in self._named_params():
            if isinstance(p.grad, ReleasedGrad):
                if set_to_none:
                    p.grad = None
            elif p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().requires_grad_(False).zero_()

    def _held_grads(self) -> list[tuple[torch.Tensor, int, dict[str, Any]]]:
        """(param, index, group) of the parameters whose ``.grad`` is a real gradient."""
        return [(p, i, g) for i, (_, p, g) in enumerate(self._named_params())
                if p.grad is not None and not isinstance(p.grad, ReleasedGrad)]


def prepare_gradient_release(model: torch.nn.Module, opt: ReleaseSteps, *, grad_norms: bool = False) -> None:
    """Registers gradient release hooks on every parameter of ``opt`` (each a parameter of
    ``model``); ``opt`` must have been built with ``gradient_release=True``. From now on
    ``backward`` steps each parameter and frees its gradient; ``opt.step()`` and
    ``opt.zero_grad()`` do nothing. ``grad_norms=True`` keeps each gradient's 2-norm on its
    :class:`ReleasedGrad`, so ``clip_grad_norm_`` returns the global norm (to log it; off by
    default: it reads every gradient once more, about 7% of a bf16 training step on the CPU, docs/memory.md).
    ValueError for an optimizer without the flag, a model already
    prepared, or an optimizer parameter that is not in the model (it would never step);
    RuntimeError in multi-process training (DDP, FSDP2)."""
    if not isinstance(grad_norms, bool):
        raise ValueError(f"grad_norms must be True or False, got {grad_norms!r}")
    if not isinstance(opt, ReleaseSteps) or not opt.gradient_release:
        raise ValueError(f"prepare_gradient_release needs a qconf optimizer built with gradient_release=True, got "
                         f"{type(opt).__name__}{'' if isinstance(opt, ReleaseSteps) else ' (not a qconf optimizer)'}")
    if getattr(model, _MODEL_ATTR, None) is not None:
        raise ValueError("this model already has gradient release hooks; call "
                         "qconf.optim.remove_gradient_release(model) first")
    if opt._release_active:
        raise ValueError("this optimizer already runs gradient release on another model")
    in_model = {id(p) for p in model.parameters()}
    params = [p for _, p, _ in opt._named_params()]
    missing = [i for i, p in enumerate(params) if id(p) not in in_model]
    if missing:
        raise ValueError(f"{opt._describe(missing[0])} of the optimizer is not a parameter of the model, so gradient "
                         "release would never step it; pass the model whose parameters the optimizer holds")
    _refuse_multi_process(params)
    handles = []
    for p in params:
        handles.append(p.register_post_accumulate_grad_hook(opt._release_param))
        handles.append(p.register_hook(_drop_marker(p)))
    setattr(model, _MODEL_ATTR, _Hooks(opt, handles))
    opt._reset_release()
    opt._release_active = True
    opt._release_norms = grad_norms


def _drop_marker(p: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A tensor pre-hook of ``p``: before backward accumulates into ``p.grad``, a ReleasedGrad
    left by the previous backward goes (accumulating into it would raise)."""
    def hook(grad: torch.Tensor) -> None:
        if isinstance(p.grad, ReleasedGrad):
            p.grad = None
    return hook


def remove_gradient_release(model: torch.nn.Module) -> None:
    """Takes the hooks of :func:`prepare_gradient_release` off ``model`` (ValueError if it has
    none): the released-gradient markers become ``None`` and the optimizer steps normally again."""
    hooks = getattr(model, _MODEL_ATTR, None)
    if hooks is None:
        raise ValueError("this model has no gradient release hooks (qconf.optim.prepare_gradient_release)")
    for h in hooks.handles:
        h.remove()
    for _, p, _ in hooks.opt._named_params():
        if isinstance(p.grad, ReleasedGrad):
            p.grad = None
    hooks.opt._reset_release()
    delattr(model, _MODEL_ATTR)
