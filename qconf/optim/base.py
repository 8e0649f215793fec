"""``QOptimizer``: the one optimizer base. It owns parameter naming, StatePlan resolution, state
creation and conversion, checkpoints, and the choice between the reference and fused paths.

Subclasses are small update rules (:mod:`qconf.optim.adam`, ``sgd``, ``lion``). Each declares
its states with :meth:`QOptimizer._state_specs` (:class:`~qconf.optim.spec.StateSpec`, each in a
kernel :class:`~qconf.optim.spec.Slot`), its kernel hyperparameters with
:meth:`QOptimizer._hyper` (a :class:`~qconf.optim.spec.Hyper`), and implements
:meth:`QOptimizer._update`, which reads and writes fp32 tensors only -- the rule never knows how
a state is stored (seeds/002). The reference step decodes each quantized state to fp32 before the
rule runs and encodes the result afterwards; the fused step (:mod:`qconf.optim.fused`) gets each
parameter described by :meth:`QOptimizer._fused_params` and runs the rule in the native kernel.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.optim import Optimizer

from .. import _native
from ..codec import Codec, QTensor
from ..config import QConfig, StatePlan, load_config, resolve_plan
from . import checkpoint
from . import weights as wts
from ._validate import check_seed
from .fused import CompiledFusedSteps, FusedParam, FusedStepper, unfusable_reason
from .params import NamedParams, compute_dtype, real_view
from .reference import ReferenceSteps
from .release import ReleaseSteps
from .sharded import finish_encodes, is_sharded, shard_geometry
from .sharded_step import ShardedSteps
from .sharded_state import agree, export_states
from .spec import Hyper, Slot, StateSpec
from .states import convert_state, zero_state

__all__ = ["QOptimizer"]

#: attributes that survive copy.deepcopy and pickling (beside torch's defaults, state, param_groups)
_PICKLED = ("qconfig", "_seed", "_enable_overrides", "_fused", "_bf16_sr", "_compensation", "_gradient_release")

class QOptimizer(NamedParams, ReferenceSteps, ShardedSteps, CompiledFusedSteps, ReleaseSteps, Optimizer):
    """Base class of qconf's low-bit optimizers (a :class:`torch.optim.Optimizer`).

    Args:
        params: parameters, ``model.named_parameters()`` (names feed the qconfig's ``overrides``),
            or param-group dicts (whose ``params`` may also be ``(name, tensor)`` pairs).
        defaults: hyperparameter defaults of the concrete optimizer.
        qconfig: path, dict or :class:`~qconf.QConfig`; None means the built-in defaults (lpmm's
            ``_C`` defaults: both states 4-bit group-128).
        fused: None = use the native kernel when available, else the reference path with a warning;
            True = native kernel or a clear error; False = reference path.
        seed: seed of the counter-based RNG used for stochastic rounding (states and weights);
            None takes ``torch.initial_seed()``. Saved in the state dict.
        bf16_stochastic_round: round updates into bf16 parameters stochastically (torchao's flag;
            the qconfig's ``weights.rounding`` does the same per parameter, for bf16 and fp16).
        compensation: ``"kahan"`` keeps a compensation buffer for every bf16/fp16 parameter,
            ``"none"`` for none; None (default) follows the qconfig's ``weights.compensation``.
        gradient_release: step each parameter inside backward and free its gradient at once, once
            :func:`~qconf.optim.prepare_gradient_release` has registered the hooks
            (:mod:`qconf.optim.release`; ``step()`` and ``zero_grad()`` then do nothing).
    """

    #: the fused kernel's update rule: ``"adam"`` (Adam and AdamW), ``"sgd"`` or ``"lion"``
    kernel_rule: str = ""
    #: whether checkpoints must carry a step count (Adam's bias correction needs it; SGD's doesn't)
    requires_step: bool = True
    #: states torch.optim creates on first use and saves as None until then (SGD momentum_buffer)
    lazy_states: tuple[str, ...] = ()
    #: group keys that torch.optim does not know (dropped by export_torch_state_dict)
    qconf_only_group_keys: tuple[str, ...] = ()
    #: group keys torch.optim expects (added by export_torch_state_dict)
    torch_group_defaults: dict[str, Any] = {}
    #: group settings giving every layout of states the rule keeps (see :mod:`qconf.optim.checkpoint`)
    layout_variants: tuple[dict[str, Any], ...] = ()

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], *, qconfig: Any = None,
                 fused: bool | None = None, seed: int | None = None, bf16_stochastic_round: bool = False,
                 compensation: str | None = None, gradient_release: bool = False) -> None:
        self._init_release(gradient_release)
        if compensation not in (None, "none", "kahan"):
            raise ValueError(f"compensation must be None, 'none' or 'kahan', got {compensation!r}")
        if not isinstance(bf16_stochastic_round, bool):
            raise ValueError(f"bf16_stochastic_round must be True or False, got {bf16_stochastic_round!r}")
        self._bf16_sr = bf16_stochastic_round
        self._compensation = compensation
        self.qconfig: QConfig = load_config(qconfig if qconfig is not None else {})
        seed = check_seed("seed", seed, none_ok=True)
        self._seed: int = torch.initial_seed() if seed is None else seed
        self._enable_overrides: dict[int, bool] = {}
        self._plans: dict[int, StatePlan] = {}
        self._index_cache: tuple[int, dict[int, int], list[tuple[str, torch.Tensor, dict[str, Any]]]] | None = None
        self._layout_version = 0  # bumped whenever states are created, converted or replaced
        self._fusable_cache: dict[int, tuple[Any, bool]] = {}
        super().__init__(params, defaults)
        self._fused = fused
        self._kernel = _choose_kernel(type(self).__name__, fused, self.kernel_rule)

    # -- copy and pickle: the qconf settings survive, caches and the kernel driver are rebuilt -----
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in _PICKLED})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        had_differentiable = "differentiable" in state["defaults"]
        super().__setstate__(state)
        if not had_differentiable:  # torch's __setstate__ adds it; qconf's groups never had it
            self.defaults.pop("differentiable", None)
        self._plans = {}
        self._index_cache = None
        self._layout_version = 0
        self._fusable_cache = {}
        self._kernel = _choose_kernel(type(self).__name__, self._fused, self.kernel_rule)
        self._reset_release()  # (the hooks stay with the original's model)

    # -- plans and states ---------------------------------------------------------------------
    def plan(self, index: int) -> StatePlan:
        """The resolved :class:`StatePlan` of parameter ``index`` (cached until overrides change)."""
        plan = self._plans.get(index)
        if plan is None:
            name, p, _ = self._named_params()[index]
            plan = self._resolve_plan(name, p, self._enable_overrides.get(index))
            self._plans[index] = plan
        return plan

    def _resolve_plan(self, name: str, p: torch.Tensor, force_enable: bool | None) -> StatePlan:
        """The qconfig's plan for ``p`` with this optimizer's weights arguments applied."""
        plan = resolve_plan(self.qconfig, name, tuple(real_view(p).shape), force_enable=force_enable)
        weights = plan.weights
        if self._bf16_sr and p.dtype == torch.bfloat16:
            weights = dataclasses.replace(weights, rounding="stochastic")
        if self._compensation is not None:
            weights = dataclasses.replace(weights, compensation=self._compensation)
        return plan if weights == plan.weights else dataclasses.replace(plan, weights=weights)

    def planned_states(self, index: int) -> list[tuple[StateSpec, Codec | None]]:
        """Every state parameter ``index`` keeps under its current plan, with its codec (None:
        stored as a ``spec.dtype`` tensor), whether or not it exists yet."""
        _, p, group = self._named_params()[index]
        plan = self.plan(index)
        return _with_codecs(self._specs(group, p, plan), plan)

    def _state_specs(self, group: dict[str, Any], p: torch.Tensor) -> list[StateSpec]:
        """The states this rule keeps for ``p`` under ``group``'s hyperparameters."""
        raise NotImplementedError

    def _update(self, p: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], step: int,
                group: dict[str, Any], new: frozenset[str]) -> None:
        """Apply one step of the update rule in fp32, in place on ``p`` and ``states``.

        ``p``: fp32 parameter values; ``grad``: fp32 gradient (read only); ``states``: fp32 state
        values keyed by spec key; ``step``: the step count after incrementing (1 on the first step);
        ``new``: keys of states created in this step (SGD starts its buffer from the gradient).
        """
        raise NotImplementedError

    def _hyper(self, group: dict[str, Any]) -> Hyper:
        """``group``'s hyperparameters for the fused kernel."""
        raise NotImplementedError

    def _rule_specs(self, group: dict[str, Any], p: torch.Tensor) -> list[StateSpec]:
        """The rule's states of ``p``, shaped like its real view (a complex parameter's states are
        ``view_as_real``-shaped, as torch.optim updates them) and, unquantized, stored in its compute
        dtype (float64 for float64 and complex128 parameters, else fp32)."""
        real = real_view(p)
        specs = self._state_specs(group, real)
        if compute_dtype(real) == torch.float64:
            specs = [dataclasses.replace(s, dtype=torch.float64) if s.dtype == torch.float32 else s for s in specs]
        return specs

    @classmethod
    def validate_group(cls, group: Mapping[str, Any]) -> dict[str, Any]:
        """A group's hyperparameters checked by the constructor's rules (``ValueError``) and
        normalized; the constructor and ``load_state_dict`` both call it."""
        raise NotImplementedError

    def _specs(self, group: dict[str, Any], p: torch.Tensor, plan: StatePlan) -> list[StateSpec]:
        """The rule's states of ``p`` plus the Kahan buffer when its weights are compensated."""
        specs = self._rule_specs(group, p)
        if p.dtype in wts.LOW_PRECISION and plan.weights.compensation == "kahan":
            specs.append(StateSpec("kahan_comp", "compensation", tuple(p.shape), Slot.COMPENSATION, p.dtype))
        return specs

    def fp32_state_count(self, group: dict[str, Any]) -> int:
        """How many fp32 param-shaped states torch.optim keeps for this rule (memory_report)."""
        return len({spec.section for spec in self._state_specs(group, _META_PARAM) if spec.section})

    def _ensure_state(self, p: torch.Tensor, index: int, group: dict[str, Any]) -> frozenset[str]:
        """Create missing states of ``p``; returns the keys created now."""
        state = self.state[p]
        if any(isinstance(v, Mapping) for v in state.values()):  # written as a state dict holds it (ZeRO)
            state = self.state[p] = checkpoint.adopt_entry(self._checkpoint_target(), index, group, state)
            self._layout_version += 1
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        plan = self.plan(index)
        geometry = shard_geometry(p)
        created = []
        for spec, codec in _with_codecs(self._specs(group, p, plan), plan):
            if state.get(spec.key) is None:
                if geometry is not None:  # the local shard's state (qconf.optim.sharded)
                    if spec.slot in (Slot.ROW, Slot.COL):
                        raise ValueError(f"{type(self).__name__}: {self._describe(index)} is sharded (a DTensor); "
                                         "factor_second_moment=True is not supported for sharded parameters")
                    spec = dataclasses.replace(spec, shape=geometry.state_shape(codec))
                state[spec.key] = zero_state(spec, codec, p.device)
                created.append(spec.key)
        if created:
            self._layout_version += 1
        return frozenset(created)

    # -- override_quantize_enable ------------------------------------------------------------
    def override_quantize_enable(self, module: torch.nn.Module, param_name: str, enable: bool) -> None:
        """Force quantization of every state of ``module.<param_name>`` on or off (lpmm's API).

        Unlike lpmm this is valid at any time: existing states are converted on the spot (decoded
        to fp32, or encoded with the codec the qconfig gives that parameter), and the override is
        saved in ``state_dict()``. ``enable=True`` quantizes even below ``min_numel``.
        """
        p = getattr(module, param_name, None)
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"{type(module).__name__} has no tensor attribute {param_name!r}")
        index = self._param_index().get(id(p))
        if index is None:
            raise ValueError(f"{type(module).__name__}.{param_name} is not optimized by this optimizer")
        self._enable_overrides[index] = bool(enable)
        self._plans.pop(index, None)
        self._requantize_param(index)

    def _requantize_param(self, index: int) -> None:
        """Bring the existing states of parameter ``index`` in line with its current plan."""
        _, p, _ = self._named_params()[index]
        state = self.state.get(p)
        if not state:
            return
        if shard_geometry(p) is not None:
            raise ValueError(f"override_quantize_enable: {self._describe(index)} is sharded and already has states; "
                             "call it before the first step")
        for spec, codec in self.planned_states(index):
            value = state.get(spec.key)
            if value is not None:
                state[spec.key] = convert_state(value, codec, spec.dtype)
        self._layout_version += 1

    # -- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        if self._release_active:  # every parameter stepped in backward (qconf.optim.release)
            return self._released_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._kernel is not None and torch.compiler.is_compiling():
            rest = self._compiled_fused_steps()  # (fused.CompiledFusedSteps)
            if rest:  # one graph break outside any loop: inside step's loop Dynamo would skip the whole frame
                self._reference_groups(rest)
            return loss
        sharded = []
        for group in self.param_groups:
            if any(is_sharded(p) for p in group["params"]):
                sharded.append(group)  # all together below: one all-reduce per step
            elif self._kernel is not None and self._fusable(group):
                self._fused_step(group)
            else:
                self._reference_group(group)
        if sharded:
            self._sharded_step(sharded)
        return loss

    @torch._disable_dynamo
    def _reference_groups(self, groups: list[dict[str, Any]]) -> None:
        """The groups a compiled step leaves to the host (reference path, Muon's matrices)."""
        for group in groups:
            self._reference_group(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; while gradient release runs, only for the gradients still held
        (the released ones are gone already: :mod:`qconf.optim.release`)."""
        if self._release_active:
            self._release_zero_grad(set_to_none)
        else:
            super().zero_grad(set_to_none)

    def _step_one(self, p: torch.Tensor, index: int, group: dict[str, Any]) -> None:
        """One step of parameter ``p`` (index ``index`` of ``group``) alone, on its gradient: the
        fused kernel (a plan of its own) or the reference path, as the group's step would take it."""
        if p.grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if self._kernel is not None and self._fusable(group):
            self._kernel.step(("release", index), *self._plan_source(group, [p]), self._hyper(group), self._seed)
        else:
            self._reference_step(p, index, group, self._ensure_state(p, index, group))

    def _fusable(self, group: dict[str, Any]) -> bool:
        """Whether every parameter of ``group`` can take the fused step. With ``fused=True`` an
        unfusable parameter is an error naming it; with ``fused=None`` the group falls back to the
        reference path with a warning. Strides do not matter: a non-contiguous parameter steps
        through a contiguous copy (:class:`~qconf.optim.fused.GroupPlan`)."""
        key = (self._layout_version, len(group["params"]))
        cached = self._fusable_cache.get(id(group))
        if cached is None or cached[0] != key:
            index = self._param_index()
            problems = [f"{self._describe(index[id(p)])} has {r}" for p in group["params"]
                        if (r := unfusable_reason(p) or self._cuda_unfused(p, index[id(p)])) is not None]
            if problems and self._fused:
                raise RuntimeError(f"{type(self).__name__}(fused=True) cannot fuse: " + "; ".join(problems))
            if problems:
                warnings.warn(f"{type(self).__name__}: using the reference path for a param group because "
                              + "; ".join(problems), stacklevel=3)
            cached = (key, not problems)
            self._fusable_cache[id(group)] = cached
        return cached[1]

    def _cuda_unfused(self, p: torch.Tensor, index: int) -> str | None:
        """What the CUDA kernels lack for ``p``: the generic kernel has no quantized Kahan buffer
        (the CPU kernel and the specialized CUDA kernels have it)."""
        w = self.plan(index).weights
        if (p.device.type == "cuda" and p.dtype in wts.LOW_PRECISION and w.compensation == "kahan"
                and w.compensation_codec is not None and _native.cuda_kernels() != "specialized"):
            return ("a quantized Kahan buffer (weights.compensation_codec), which only the specialized CUDA kernels "
                    "implement (QCONF_CUDA_KERNELS=specialized); or drop compensation_codec to keep the buffer in "
                    "the parameter's dtype")
        return None

    def _spec_signature(self, group: dict[str, Any]) -> tuple:
        """The group hyperparameters that decide which states exist (cached plans depend on it)."""
        return ()

    def _plan_source(self, group: dict[str, Any], params: list[torch.Tensor] | None = None
                     ) -> tuple[Callable[[], Any], Callable[[], list[FusedParam]]] | None:
        """The key and describe callables of the fused plan (see ``FusedStepper.plan``) of ``group``'s
        parameters (or of ``params``, some of them) that have gradients; None when none has."""
        params = group["params"] if params is None else params
        have = None
        if any(p.grad is None for p in params):
            have = tuple(p.grad is not None for p in params)
            params = [p for p in params if p.grad is not None]
            if not params:
                return None
        signature = self._spec_signature(group)
        # the state entries' identities: opt.state.clear(), del opt.state[p] or opt.state[p] = {...}
        # (ZeroRedundancyOptimizer.load_state_dict) orphan the plan's tensors; which parameters are
        # non-contiguous (they step through a copy, outside the C++ plan: fused.GroupPlan) can
        # change with ``p.data = ...``
        return ((lambda: (self._layout_version, have, signature, tuple(id(self.state.get(p)) for p in params),
                          tuple(k for k, p in enumerate(params) if not p.is_contiguous()))),
                (lambda: self._fused_params(group, params)))

    def _fused_step(self, group: dict[str, Any]) -> None:
        """One fused kernel call for the parameters of ``group`` that have gradients."""
        source = self._plan_source(group)
        if source is not None:
            self._kernel.step(id(group), *source, self._hyper(group), self._seed)

    def _fused_params(self, group: dict[str, Any], params: list[torch.Tensor]) -> list[FusedParam]:
        """Check ``params``, create their missing states, and describe them for the kernel."""
        index = self._param_index()
        new = {}
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            reason = unfusable_reason(p.to_local() if is_sharded(p) else p)
            if reason is not None:
                raise RuntimeError(f"{type(self).__name__}(fused=True): {self._describe(index[id(p)])} has {reason}")
            new[index[id(p)]] = self._ensure_state(p, index[id(p)], group)
        out = []
        for p in params:
            i = index[id(p)]
            state, plan, geo = self.state[p], self.plan(i), shard_geometry(p)
            out.append(FusedParam(i, p if geo is None else p.to_local(), state["step"],
                                  {s.slot: state[s.key] for s in self._specs(group, p, plan)},
                                  stochastic_weights=plan.weights.rounding == "stochastic",
                                  first=any(k in new[i] for k in self.lazy_states),
                                  rng_offset=0 if geo is None else geo.offset))
        return out

    # -- checkpoints -----------------------------------------------------------------------------
    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict as plain data with qconf's section in every param group (layout:
        :func:`checkpoint.pack`); ``torch.load(weights_only=True)`` loads it. Hooks run as in torch:
        pre-hooks first, post-hooks see (and may replace) the plain dict."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = checkpoint.pack(self.param_groups, export_states(self.state), checkpoint.section(
            type(self).__name__, self.qconfig.to_dict(), self._seed, self._enable_overrides))
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            sd = sd if result is None else result
        return sd

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a qconf state dict (any qconfig, format 1 or 2) or a torch.optim AdamW/Adam/SGD one
        (what is accepted: :mod:`qconf.optim.checkpoint`); hooks run as in torch. Everything is
        validated first: on error a ``ValueError`` names the group or parameter and key, and the
        optimizer is left exactly as it was."""
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)  # pre-hooks get a shallow copy, as in torch
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        loaded = self._parse_checkpoint(state_dict)
        self._layout_version += 1
        self._enable_overrides, self._seed, self._plans = loaded.enable_overrides, loaded.seed, {}
        for group, new in zip(self.param_groups, loaded.groups):
            own = {k: group[k] for k in ("params", "param_names") if k in group}
            group.clear()  # in place: caches keyed by id(group) stay valid (the layout version moved)
            group.update(new, **own)
        self.state.clear()
        params = [p for _, p, _ in self._named_params()]
        self.state.update({params[index]: entry for index, entry in loaded.states.items()})
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _parse_checkpoint(self, state_dict: Any) -> checkpoint.Loaded:
        """:func:`checkpoint.parse`; with sharded parameters every rank learns whether all ranks
        accepted it (so none waits in a collective) and re-encodes what must be, together."""
        params = [p for _, p, _ in self._named_params()]
        if not any(is_sharded(p) for p in params):
            return checkpoint.parse(state_dict, self._checkpoint_target())
        try:
            loaded, error = checkpoint.parse(state_dict, self._checkpoint_target()), None
        except ValueError as e:
            loaded, error = None, e
        if not agree(error is None, params):
            raise error or ValueError("load_state_dict: the checkpoint was refused on another rank; the optimizer "
                                      "was left unchanged")
        finish_encodes(loaded.pending)
        return loaded

    def _checkpoint_target(self) -> checkpoint.Target:
        """What :func:`checkpoint.parse` needs to know about this optimizer."""
        named = self._named_params()

        def planned(index: int, group: dict[str, Any], force_enable: bool | None
                    ) -> list[tuple[StateSpec, Codec | None]]:
            name, p, _ = named[index]
            plan = self._resolve_plan(name, p, force_enable)
            return _with_codecs(self._specs(group, p, plan), plan)

        return checkpoint.Target(
            optimizer=type(self).__name__, defaults=self.defaults, param_groups=self.param_groups,
            names=[n for n, _, _ in named], params=[p for _, p, _ in named], seed=self._seed,
            enable_overrides=self._enable_overrides, requires_step=self.requires_step,
            lazy_states=self.lazy_states, planned_states=planned, validate_group=self.validate_group,
            layout_variants=self.layout_variants)


_META_PARAM = torch.empty(2, device="meta")  # 1-D stand-in: no factoring, one spec per torch.optim state


def _with_codecs(specs: list[StateSpec], plan: StatePlan) -> list[tuple[StateSpec, Codec | None]]:
    """Each spec with its codec under ``plan`` (None: never quantized, or disabled)."""
    out = []
    for spec in specs:
        if spec.section == "compensation":
            codec = plan.weights.codec()
        else:
            codec = plan.codec(spec.section) if spec.section is not None else None
        out.append((spec, codec))
    return out


def _choose_kernel(opt_name: str, fused: bool | None, rule: str) -> FusedStepper | None:
    """Native kernel driver or None (reference path), following the ``fused`` argument."""
    if fused is not None and not isinstance(fused, bool):
        raise ValueError(f"fused must be None, True or False, got {fused!r}")
    if fused is False:
        return None
    if _native.fused_available():
        return FusedStepper(rule)
    if fused:
        raise RuntimeError(f"{opt_name}(fused=True) needs the native extension qconf._C, which is not built "
                           f"({_native.native_error()}); reinstall with `pip install --no-build-isolation .` "
                           "or pass fused=None/False for the reference path")
    warnings.warn(f"{opt_name}: native extension qconf._C is unavailable ({_native.native_error()}); "
                  "using the (slower) reference path", stacklevel=3)
    return None
