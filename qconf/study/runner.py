"""One training run of a study: a task, one qconfig, one seed.

:func:`train_run` trains ``task.make_model(seed)`` on ``task.batches(seed)`` with a qconf optimizer
and records everything ``qconf compare`` reports: the train-loss curve (every step), the eval curve
(every ``eval_every`` steps and at the last step), divergence, step times, state bytes/param and the
quantization error of every optimizer state.

**Quantization error.** Next to the optimizer under test runs a *shadow*: an optimizer of the same
class and hyperparameters with quantization off, on a detached copy of the parameters. Before each
step the shadow's parameters are set to the model's and it receives a copy of the same gradients,
so its states are what an fp32 optimizer would hold on this very trajectory. At each evaluation
the normalized error of every state is measured over all parameters::

    nmse(state) = sum_params sum((decode(q) - s)^2) / sum_params sum(s^2)

(q: the state of the optimizer under test, s: the shadow's fp32 state). For AdamW/Lion/SGD without
coupled weight decay the states depend on the gradients alone, so the shadow's parameters do not
matter; syncing them makes the measurement exact for coupled decay (Adam, SGD ``weight_decay``) too.
Muon's momentum depends on the gradients alone as well, so its shadow skips Newton–Schulz
(``ns_steps=0``: on the CPU the bf16 iterations are most of a Muon step).
For Adam/AdamW two diagnostics of the second moment's zero point are added: ``v_zero`` -- the share
of elements whose fp32 ``v`` is positive but whose stored ``v`` decodes to exactly 0 -- and
``update`` -- the nmse of the update direction ``m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable

import torch

from ..codec import QTensor
from ..config import QConfig, load_config
from ..memory import memory_report
from ..nn import quantize_
from .. import optim as qoptim
from .task import Task

OPTIMIZERS: dict[str, type] = {"adamw": qoptim.AdamW, "adam": qoptim.Adam, "sgd": qoptim.SGD, "lion": qoptim.Lion,
                               "muon": qoptim.Muon}
#: optimizer arguments the study adds to the optimizer's own defaults
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {"sgd": {"momentum": 0.9}}
#: quantization off (= configs/fp32.yml), for the shadow optimizer
FP32_CONFIG: dict[str, Any] = {"states": {"exp_avg": {"enable": False}, "exp_avg_sq": {"enable": False}}}
WARMUP_FRACTION = 0.1  # divergence by "eval loss above the initial one" is checked after 10% of the steps
TIMING_SKIP = 5        # the first steps (allocation, plan resolution, caches) are not timed


@dataclasses.dataclass
class RunResult:
    """Everything recorded for one (config, seed) run; plain data (``dataclasses.asdict`` -> JSON).

    ``status`` is ``"ok"`` (all steps done), ``"diverged"`` (stopped early: ``reason`` says why),
    ``"crashed"`` (an exception in the task, model or optimizer: ``reason`` has it in one line) or
    ``"interrupted"`` (Ctrl-C; the curves hold what was done). ``eval`` holds one dict per
    evaluation: ``{"step": int, "loss": float, ...the task's other metrics}``; step 0 is the initial
    model. ``qerr`` maps a state name to ``[[step, nmse], ...]``.
    """

    config: str
    seed: int
    status: str = "ok"
    reason: str = ""
    steps_done: int = 0
    diverged_at: int | None = None
    train_loss: list[float] = dataclasses.field(default_factory=list)
    eval: list[dict[str, float]] = dataclasses.field(default_factory=list)
    qerr: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)
    step_ms: float | None = None
    opt_ms: float | None = None
    state_bytes_per_param: float | None = None
    train_bytes_per_param: float | None = None  #: parameters + gradients + states (memory_report)
    wall_s: float = 0.0

    @property
    def diverged(self) -> bool:
        """Whether the run stopped early because it diverged."""
        return self.status == "diverged"

    @property
    def final_eval(self) -> dict[str, float] | None:
        """The last evaluation after training started (None if the run never reached one)."""
        return self.eval[-1] if len(self.eval) > 1 else None

    @property
    def best_eval_loss(self) -> float | None:
        """The lowest finite eval loss after training started (None if there is none)."""
        losses = [e["loss"] for e in self.eval[1:] if math.isfinite(e["loss"])]
        return min(losses) if losses else None

    def final_qerr(self, state: str) -> float | None:
        """The state's error at the last evaluation where it was finite (None if never measured)."""
        finite = [v for _, v in self.qerr.get(state, []) if v is not None and math.isfinite(v)]
        return finite[-1] if finite else None

    def to_dict(self) -> dict[str, Any]:
        """The run as plain data, with the derived final/best values (an entry of results.json's runs)."""
        d = dataclasses.asdict(self)
        d["final_eval"] = self.final_eval
        d["best_eval_loss"] = self.best_eval_loss
        d["final_qerr"] = {k: self.final_qerr(k) for k in self.qerr}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunResult":
        """Rebuild from :meth:`to_dict` (the derived values are recomputed, not read)."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def make_optimizer(name: str, params: Any, *, lr: float, qconfig: Any, fused: bool | None,
                   kwargs: dict[str, Any] | None = None) -> torch.optim.Optimizer:
    """``qconf.optim.<name>(params, lr=lr, qconfig=qconfig, fused=fused, **defaults, **kwargs)``."""
    cls = OPTIMIZERS[name]
    return cls(params, lr=lr, qconfig=qconfig, fused=fused, **{**OPTIMIZER_DEFAULTS.get(name, {}), **(kwargs or {})})


class _Shadow:
    """The fp32 twin of an optimizer (see the module docstring)."""

    def __init__(self, opt_name: str, named: list[tuple[str, torch.nn.Parameter]], lr: float, fused: bool | None,
                 kwargs: dict[str, Any] | None) -> None:
        self.pairs = [(p, p.detach().clone()) for _, p in named]
        if opt_name == "muon":  # its momentum depends on the gradients alone and the parameters are
            kwargs = {**(kwargs or {}), "ns_steps": 0}  # synced before each step: Newton–Schulz is not needed
        self.opt = make_optimizer(opt_name, [(n, s) for (n, _), (_, s) in zip(named, self.pairs)], lr=lr,
                                  qconfig=load_config(FP32_CONFIG), fused=fused, kwargs=kwargs)

    def feed(self, lrs: list[float], grads: bool = True) -> None:
        """Take the model's current parameters, a copy of its gradients (call before the real
        step; ``grads=False``: the hooks of :meth:`feed_in_backward` took them already) and each
        param group's lr (``lrs``: the groups correspond -- Muon's two parts have their own)."""
        if grads:
            for p, s in self.pairs:
                self._take(p, s)
        for g, lr in zip(self.opt.param_groups, lrs, strict=True):
            g["lr"] = lr

    def feed_in_backward(self) -> None:
        """With gradient release the model's parameters step inside backward and their gradients
        are freed: a post-accumulate-grad hook registered before the release hooks (hooks run in
        registration order) takes each parameter and gradient just before its step."""
        for p, s in self.pairs:
            p.register_post_accumulate_grad_hook(lambda p, s=s: self._take(p, s))

    @staticmethod
    def _take(p: torch.Tensor, s: torch.Tensor) -> None:
        s.copy_(p.detach())
        s.grad = None if p.grad is None else p.grad.detach().clone()

    def step(self) -> None:
        self.opt.step()


def _as_fp32(value: Any) -> torch.Tensor:
    return value.decode() if isinstance(value, QTensor) else value.detach().float()


def state_errors(opt: torch.optim.Optimizer, shadow: torch.optim.Optimizer, params: list[torch.Tensor],
                 shadow_params: list[torch.Tensor]) -> dict[str, float]:
    """Normalized MSE of every state of ``opt`` against ``shadow`` over all parameters, plus the
    ``v_zero`` and ``update`` diagnostics for Adam-family optimizers (module docstring)."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    zero_hits = positives = 0
    adam = isinstance(opt, qoptim.AdamW) or isinstance(opt, qoptim.Adam)
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    for p, sp in zip(params, shadow_params):
        st, ss = opt.state.get(p), shadow.state.get(sp)
        if not st or not ss:
            continue
        decoded = {}
        for key, ref in ss.items():
            if key == "step" or not isinstance(ref, torch.Tensor) or key not in st or st[key] is None:
                continue
            q = _as_fp32(st[key])
            decoded[key] = q
            ref = ref.float()
            num[key] = num.get(key, 0.0) + (q - ref).double().square().sum().item()
            den[key] = den.get(key, 0.0) + ref.double().square().sum().item()
            if key == "exp_avg_sq":
                pos = ref > 0
                positives += int(pos.sum().item())
                zero_hits += int((pos & (q == 0)).sum().item())
        if adam and "exp_avg" in decoded and "exp_avg_sq" in decoded:
            group = groups[id(p)]
            beta2, eps = group["betas"][1], group["eps"]
            t = float(st["step"])
            c2 = 1.0 / math.sqrt(1.0 - beta2 ** t)
            u_q = decoded["exp_avg"] / (decoded["exp_avg_sq"].sqrt() * c2 + eps)
            u_s = ss["exp_avg"].float() / (ss["exp_avg_sq"].float().sqrt() * c2 + eps)
            num["update"] = num.get("update", 0.0) + (u_q - u_s).double().square().sum().item()
            den["update"] = den.get("update", 0.0) + u_s.double().square().sum().item()
    out = {k: (num[k] / den[k] if den[k] > 0 else (0.0 if num[k] == 0 else math.inf)) for k in num}
    if positives:
        out["v_zero"] = zero_hits / positives
    return out


def _evaluate(task: Task, model: torch.nn.Module) -> dict[str, float]:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            metrics = task.evaluate(model)
    finally:
        model.train(was_training)
    if not isinstance(metrics, dict) or "loss" not in metrics:
        raise TypeError(f"task {task.name!r}: evaluate(model) must return a dict with a 'loss' entry, got {metrics!r}")
    return {k: float(v) for k, v in metrics.items()}


def _check_eval(task: Task, model: torch.nn.Module, opt: torch.optim.Optimizer, shadow: _Shadow | None,
                result: RunResult, step: int, warmup: int, initial_loss: float) -> bool:
    """Evaluate after ``step``; record the metrics and (with a shadow) the state errors in ``result``;
    True if the run diverged (``result.reason`` says why)."""
    metrics = _evaluate(task, model)
    result.eval.append({"step": step, **metrics})
    if shadow is not None:
        params, shadow_params = [p for p, _ in shadow.pairs], [s for _, s in shadow.pairs]
        for key, value in state_errors(opt, shadow.opt, params, shadow_params).items():
            result.qerr.setdefault(key, []).append([step, value])
    if not math.isfinite(metrics["loss"]):
        result.reason = f"non-finite eval loss at step {step}"
        return True
    if step >= warmup and metrics["loss"] > initial_loss:
        result.reason = (f"eval loss {metrics['loss']:.4g} above the initial {initial_loss:.4g} "
                         f"at step {step}")
        return True
    return False


def train_run(task: Task, qconfig: QConfig, label: str, seed: int, *, optimizer: str = "adamw", steps: int,
              lr: float, fused: bool | None = None, eval_every: int, optimizer_kwargs: dict[str, Any] | None = None,
              measure_error: bool = True, on_step: Callable[[int, float], None] | None = None) -> RunResult:
    """Train one (config, seed) run and return its :class:`RunResult`.

    ``on_step(step, train_loss)`` is called after every step (progress bars). An exception from the
    task, the model or the optimizer ends the run with ``status="crashed"``. A KeyboardInterrupt
    inside the run is caught: the result comes back with ``status="interrupted"`` and the caller
    decides whether to stop (the exception is re-raised wrapped as :class:`RunInterrupted`).
    """
    result = RunResult(config=label, seed=seed)
    start = time.perf_counter()
    step_times: list[float] = []
    opt_times: list[float] = []
    opt = None
    try:
        model = task.make_model(seed)
        if qconfig.bitnet.enable:  # BitNet b1.58 layers, as the config's bitnet section selects
            quantize_(model, qconfig)
        model.train()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        opt = make_optimizer(optimizer, named, lr=lr, qconfig=qconfig, fused=fused, kwargs=optimizer_kwargs)
        sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: task.lr_schedule(s, steps))
                 if task.lr_schedule is not None else None)
        shadow = _Shadow(optimizer, named, lr, fused, _without_release(optimizer_kwargs)) if measure_error else None
        release = _prepare_release(model, opt, shadow)

        initial = _evaluate(task, model)
        result.eval.append({"step": 0, **initial})
        warmup = math.ceil(WARMUP_FRACTION * steps)
        batches = task.batches(seed)

        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            batch = next(batches)
            opt.zero_grad(set_to_none=True)
            loss = task.loss(model, batch)
            value = float(loss.detach())
            result.train_loss.append(value)
            if not math.isfinite(value):
                result.status, result.diverged_at = "diverged", step
                result.reason = f"non-finite train loss ({value}) at step {step}"
                result.steps_done = step - 1
                break
            loss.backward()
            t1 = time.perf_counter()
            if shadow is not None:  # not timed
                shadow.feed([g["lr"] for g in opt.param_groups], grads=not release)
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if shadow is not None:
                shadow.step()
            if sched is not None:
                sched.step()
            result.steps_done = step
            if step > TIMING_SKIP:
                step_times.append((t1 - t0) + (t3 - t2))
                opt_times.append(t3 - t2)
            if on_step is not None:
                on_step(step, value)
            if (step % eval_every == 0 or step == steps) and _check_eval(task, model, opt, shadow, result, step,
                                                                          warmup, initial["loss"]):
                result.status, result.diverged_at = "diverged", step
                break
    except KeyboardInterrupt:
        result.status = "interrupted"
        result.reason = f"interrupted (Ctrl-C) after {result.steps_done} of {steps} steps"
        raise RunInterrupted(result) from None
    except Exception as e:  # noqa: BLE001 - a study records a crashed run and goes on with the others
        result.status = "crashed"
        result.reason = f"crashed after {result.steps_done} of {steps} steps: {type(e).__name__}: " + " ".join(
            str(e).split())[:500]
    finally:
        _finish(result, opt, time.perf_counter() - start, step_times, opt_times)
    return result


def _finish(result: RunResult, opt: torch.optim.Optimizer | None, wall_s: float, step_times: list[float],
            opt_times: list[float]) -> None:
    """Record the run's wall time, memory (``qconf.memory_report``) and median step times."""
    result.wall_s = wall_s
    if opt is not None:
        report = memory_report(opt)
        result.state_bytes_per_param = report.bytes_per_param
        result.train_bytes_per_param = report.train_bytes_per_param
    if step_times:
        result.step_ms = 1e3 * statistics.median(step_times)
        result.opt_ms = 1e3 * statistics.median(opt_times)


def _prepare_release(model: torch.nn.Module, opt: torch.optim.Optimizer, shadow: _Shadow | None) -> bool:
    """With ``gradient_release=True`` (qconf.optim.release) each parameter steps in backward and
    ``opt.step()`` has nothing left: the hooks go on, the shadow's first. Returns whether they did."""
    if not getattr(opt, "gradient_release", False):
        return False
    if shadow is not None:
        shadow.feed_in_backward()
    qoptim.prepare_gradient_release(model, opt)
    return True


def _without_release(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The optimizer arguments of the fp32 shadow: the run's, but stepping normally."""
    return None if kwargs is None else {k: v for k, v in kwargs.items() if k != "gradient_release"}


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; ``.result`` holds the partial :class:`RunResult`."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(result.reason)
        self.result = result
