"""Training-memory benchmark (``qconf bench --memory``): peak bytes per parameter of training a
GPT-style transformer (:mod:`qconf.bench.model`, 105M parameters by default) with each optimizer,
split into parameters, gradients, optimizer state and the rest, plus the mean step time and the
final loss.

Every row runs in a fresh child process (:func:`child_main`, started by :func:`measure_row` with
:data:`~qconf.bench.rss.CHILD_MALLOC_ENV`): it builds the model in the row's dtype from a seeded
initialization, builds the optimizer, trains ``warmup`` steps (forward, backward, ``opt.step()``,
``opt.zero_grad()``) on seeded random tokens, then ``steps`` measured steps. Rows on the same
device see the same initial weights and the same batches, so a gradient-release row and its
normal counterpart train the very same steps.

Attribution (also written to the JSON as ``settings.attribution``), in bytes, then divided by the
parameter count:

- ``params``: sum of ``numel * element_size`` of the model's parameters.
- ``grads``: the most gradient bytes alive at the same time during the warm-up steps (the same
  parameters get the same gradients in every step; the probe is off in the timed ones). A
  post-accumulate-grad hook on every parameter, registered before gradient release's hooks (hooks
  run in registration order, so it sees the real gradient), sums the bytes of the parameters whose
  ``.grad`` is a real tensor (not None, not a :class:`~qconf.optim.release.ReleasedGrad`); the
  maximum over its calls. For a normal step that is every gradient (at the last accumulation);
  with gradient release, about the largest single parameter's.
- ``states``: the optimizer's state tensors after warm-up: for qconf :func:`qconf.memory_report`
  (packed codes + scales + fp32 states), for the others the tensors in ``opt.state`` (wrapper
  subclasses such as torchao's flattened, shared storages once; :func:`qconf.bench.tensors.state_bytes`).
  Step counters are not counted.
- ``peak``: on the CPU, the high-water RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` = 5
  after warm-up; where that file is not writable, ``VmRSS`` sampled every 0.5 ms) during the
  measured steps, minus the child's RSS before the model existed (after ``gc`` and
  ``malloc_trim``, the row's optional package already imported). On CUDA,
  ``torch.cuda.max_memory_allocated`` during the measured steps (``reset_peak_memory_stats`` after
  warm-up) minus ``memory_allocated`` before the model existed.
- ``params_grads_states`` = params + grads + states; ``other`` = peak - params_grads_states
  (activations, autograd and kernel workspace, the allocator's and runtime's own memory).

Muon (``--muon``, :func:`muon_rows`): :class:`qconf.optim.Muon` on ``model.named_parameters()``
(Muon for the hidden matrices, qconf AdamW for the embeddings, the head, norms and biases, routed
by shape and name) beside torch's own pairing, :class:`TorchMuonAdamW` (torch.optim.Muon on the
same matrices, torch's fused AdamW on the rest). Their ``states`` are both parts' together; the
row's ``state_parts`` splits them (:func:`state_parts`).

``step_ms`` is the median wall time of the measured steps (forward + backward + optimizer step +
``zero_grad``; ``synchronize`` before and after each on CUDA). On the CPU it comes from a second
child that trains the same steps under glibc's default allocator (:func:`measure_row`: the memory
child's allocator settings, which make RSS follow the live bytes, cost a page fault per fresh
allocation and would slow every row); ``final_loss`` is the last measured step's loss. A gradient-release row names its normal counterpart; ``loss_matches_counterpart`` says
whether their final losses are equal bit for bit.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import importlib.util
import json
import statistics
import sys
import warnings
from typing import Any, Callable, Sequence

import torch

from .. import optim as qoptim
from ..memory import memory_report
from ..optim.release import ReleasedGrad
from .device import Backend, cuda_info, make_backend
from .measure import package_version, machine_info, one_line
from .model import MODEL_PRESETS, GPT, build_model, random_batches
from .muon_pair import TorchMuonAdamW, state_parts
from .roster import LR, WEIGHT_DECAY, contenders, matches
from .rss import CHILD_MALLOC_ENV, malloc_trim, run_child, reset_hwm, sampled_peak_kb, status_kb
from .tensors import state_bytes

#: the devices a memory run covers when ``--device`` is not given
DEVICES = ("cpu", "cuda")
#: the b_per_param / bytes fields of every row, in table order
FIELDS = ("params", "grads", "states", "other", "params_grads_states", "peak")
#: printed before the child's JSON result line
_CHILD_MARK = "@@qconf-bench-memory@@ "
#: what the child interpreter runs (``sys.argv[1]`` is the JSON spec)
_CHILD_CODE = "import sys, qconf.bench.memory as m; sys.exit(m.child_main(sys.argv[1]))"
#: the 4-bit config with bf16 parameters written by stochastic rounding (rows 4 and 5)
BF16_SR_QCONFIG = {"base": "default", "weights": {"rounding": "stochastic"}}

ATTRIBUTION = {
    "params": "sum of numel x element size of the model's parameters",
    "grads": "the most gradient bytes alive at once during the warm-up steps: a post-accumulate-grad hook on every "
             "parameter, registered before gradient release's, sums the bytes of the parameters whose .grad is a real "
             "tensor (not None, not a ReleasedGrad); max over its calls",
    "states": "the optimizer's state tensors after warm-up (qconf: memory_report, packed codes + scales + fp32 "
              "states; others: the tensors in opt.state), step counters excluded",
    "peak": {"cpu": "VmHWM during the measured steps (reset through /proc/self/clear_refs = 5 after warm-up, or VmRSS "
                    "sampled every 0.5 ms) minus the child's RSS before the model existed",
             "cuda": "torch.cuda.max_memory_allocated during the measured steps (reset_peak_memory_stats after "
                     "warm-up) minus memory_allocated before the model existed"},
    "params_grads_states": "params + grads + states",
    "other": "peak - params_grads_states (activations, workspace, allocator and runtime)",
}


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """One table row: ``build(model) -> optimizer`` on a model in ``dtype``. ``requires`` names a
    module that must be importable, ``cuda_only`` rows exist on CUDA only, ``release`` rows run
    :func:`qconf.optim.prepare_gradient_release` (with ``grad_norms`` as given) and compare their
    loss with ``counterpart``'s."""

    key: str
    name: str
    dtype: torch.dtype
    build: Callable[[GPT], Any]
    requires: str | None = None
    family: str = "torch"
    cuda_only: bool = False
    release: bool = False
    counterpart: str | None = None
    grad_norms: bool = False


def _torch_adamw(model: GPT) -> Any:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def _qconf_adamw(qconfig: Any, release: bool = False) -> Callable[[GPT], Any]:
    def build(model: GPT) -> Any:
        return qoptim.AdamW(model.named_parameters(), lr=LR, weight_decay=WEIGHT_DECAY, qconfig=qconfig,
                            gradient_release=release)
    return build


def _flashoptim_adamw(model: GPT) -> Any:
    flashoptim = importlib.import_module("flashoptim")
    return flashoptim.FlashAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def _torch_muon(model: GPT) -> Any:
    return TorchMuonAdamW(model.named_parameters())


def _qconf_muon(qconfig: Any, release: bool = False) -> Callable[[GPT], Any]:
    def build(model: GPT) -> Any:
        return qoptim.Muon(model.named_parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                           adamw={"lr": LR, "weight_decay": WEIGHT_DECAY}, qconfig=qconfig, gradient_release=release)
    return build


def _roster_row(key: str) -> MemoryRow:
    """The step benchmark's contender ``key`` (torchao, bitsandbytes) as a memory row."""
    c = {c.key: c for c in contenders()}[key]
    dtype = str(c.dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
    return MemoryRow(c.key, f"{c.label} {dtype}", c.dtype, lambda model: c.build(list(model.parameters())),
                     requires=c.requires, family=c.family)


def memory_rows(device: str = "cpu") -> list[MemoryRow]:
    """Every row on ``device`` (``cpu`` or ``cuda``), in table order."""
    f32, bf16 = torch.float32, torch.bfloat16
    sr, plain = "qconf-default-bf16-sr", "qconf-default-fp32"
    rows = [
        MemoryRow("torch-fused", "torch AdamW fused fp32", f32, _torch_adamw),
        MemoryRow("torch-fused-bf16", "torch AdamW fused bf16", bf16, _torch_adamw),
        MemoryRow(plain, "qconf default.yml fp32", f32, _qconf_adamw("default"), family="qconf"),
        MemoryRow(sr, "qconf default.yml bf16 SR", bf16, _qconf_adamw(BF16_SR_QCONFIG), family="qconf"),
        MemoryRow(f"{sr}-release", "qconf default.yml bf16 SR, gradient release", bf16,
                  _qconf_adamw(BF16_SR_QCONFIG, release=True), family="qconf", release=True, counterpart=sr),
        MemoryRow(f"{sr}-release-norms", "qconf default.yml bf16 SR, gradient release keeping grad norms", bf16,
                  _qconf_adamw(BF16_SR_QCONFIG, release=True), family="qconf", release=True, counterpart=sr,
                  grad_norms=True),
        MemoryRow(f"{plain}-release", "qconf default.yml fp32, gradient release", f32,
                  _qconf_adamw("default", release=True), family="qconf", release=True, counterpart=plain),
        MemoryRow("qconf-8bit-fp32", "qconf 8bit.yml fp32", f32, _qconf_adamw("8bit"), family="qconf"),
    ]
    rows += [_roster_row(key) for key in ("torchao-adamw4bit", "torchao-adamw8bit", "bnb-adamw8bit")]
    rows.append(MemoryRow("flashoptim-adamw", "flashoptim FlashAdamW bf16", bf16, _flashoptim_adamw,
                          requires="flashoptim", family="flashoptim", cuda_only=True))
    return [r for r in rows if device == "cuda" or not r.cuda_only]


def muon_rows(device: str = "cpu") -> list[MemoryRow]:
    """The ``--muon`` rows on ``device``, in table order: torch's Muon + AdamW (fp32), qconf Muon with
    8-bit momentum (fp32 parameters) and with 4-bit momentum on bf16 parameters with stochastic
    rounding, normal and with gradient release; then two AdamW rows of :func:`memory_rows` on the
    same model for comparison (torch fused fp32, qconf 4-bit bf16 SR with gradient release)."""
    f32, bf16 = torch.float32, torch.bfloat16
    sr = "muon-default-bf16-sr"
    rows = [
        MemoryRow("muon-torch", "torch Muon + AdamW fused fp32", f32, _torch_muon),
        MemoryRow("muon-8bit-fp32", "qconf Muon muon_8bit.yml fp32", f32, _qconf_muon("muon_8bit"), family="qconf"),
        MemoryRow(sr, "qconf Muon default.yml bf16 SR", bf16, _qconf_muon(BF16_SR_QCONFIG), family="qconf"),
        MemoryRow(f"{sr}-release", "qconf Muon default.yml bf16 SR, gradient release", bf16,
                  _qconf_muon(BF16_SR_QCONFIG, release=True), family="qconf", release=True, counterpart=sr),
    ]
    adamw = {r.key: r for r in memory_rows(device)}
    return rows + [adamw[k] for k in ("torch-fused", "qconf-default-bf16-sr-release")]


def roster(device: str, muon: bool) -> list[MemoryRow]:
    """:func:`muon_rows` or :func:`memory_rows` on ``device``."""
    return muon_rows(device) if muon else memory_rows(device)


def select_rows(rows: list[MemoryRow], patterns: Sequence[str] | None) -> list[MemoryRow]:
    """Rows whose key matches one of the fnmatch ``patterns`` (all when None); ValueError naming a
    pattern that matches no row."""
    if not patterns:
        return list(rows)
    unknown = [p for p in patterns if not any(matches(r.key, [p]) for r in rows)]
    if unknown:
        raise ValueError(f"--contenders: {', '.join(map(repr, unknown))} match no --memory row "
                         f"(known: {', '.join(r.key for r in rows)})")
    return [r for r in rows if matches(r.key, patterns)]


# -- the child process -------------------------------------------------------------------------------
class GradProbe:
    """The most gradient bytes alive at once: a post-accumulate-grad hook on each of ``params``
    (register it before gradient release's, so that it sees the real gradient) sums the bytes of
    the real ``.grad`` tensors of all of them; ``peak`` is the maximum over its calls."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self.peak = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._seen) for p in self.params]

    def remove(self) -> None:
        """Take the hooks off (``peak`` keeps its value)."""
        for h in self.handles:
            h.remove()

    def alive_bytes(self) -> int:
        """Bytes of the parameters' gradients that are real tensors now."""
        return sum(p.grad.numel() * p.grad.element_size() for p in self.params
                   if p.grad is not None and not isinstance(p.grad, ReleasedGrad))

    def _seen(self, _param: torch.Tensor) -> None:
        self.peak = max(self.peak, self.alive_bytes())


def optimizer_state_bytes(opt: Any) -> int:
    """Bytes of ``opt``'s state tensors (qconf: :func:`qconf.memory_report`; others:
    :func:`qconf.bench.tensors.state_bytes`); step counters excluded."""
    if isinstance(opt, qoptim.QOptimizer):
        return memory_report(opt).total_bytes
    return state_bytes(opt)


def train_step(model: GPT, opt: Any, batch: tuple[torch.Tensor, torch.Tensor], backend: Backend) -> tuple[float, float]:
    """One training step (forward, backward, ``opt.step()``, ``opt.zero_grad()``) on ``batch``
    (``(idx, targets)``, both ``(batch, seq)`` int64): ``(milliseconds, loss)``."""
    backend.sync()
    t0 = backend.clock()
    loss = model.loss(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    backend.sync()
    return (backend.clock() - t0) / 1e6, loss.item()


def _baseline_bytes(backend: Backend) -> int:
    """Memory in use before the model exists: device bytes allocated, or the RSS after ``gc`` and
    ``malloc_trim``."""
    gc.collect()
    if backend.measures_memory:
        backend.sync()
        return backend.allocated()
    malloc_trim()
    return status_kb("VmRSS") * 1024


def _peak_bytes(backend: Backend, run: Callable[[], None]) -> tuple[int, str]:
    """``run()`` and the peak memory during it: ``(bytes, method)`` (device peak allocated, VmHWM
    after a clear_refs reset, or the highest VmRSS sample)."""
    gc.collect()
    if backend.measures_memory:
        backend.sync()
        backend.reset_peak()
        run()
        backend.sync()
        return backend.max_allocated(), "max_memory_allocated"
    malloc_trim()
    if reset_hwm():
        run()
        return status_kb("VmHWM") * 1024, "clear_refs"
    return sampled_peak_kb(run, 1, status_kb("VmRSS")) * 1024, "sampling"


def measure_in_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the row ``spec["key"]`` on ``spec["device"]`` and measure it (see the module docstring);
    the raw numbers (bytes, per-step ms and losses)."""
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    row = {r.key: r for r in roster(spec["device"], spec.get("muon", False))}[spec["key"]]
    if row.requires is not None:  # its import is not the training's memory
        importlib.import_module(row.requires)
    backend = make_backend(spec["device"])
    cfg = MODEL_PRESETS[spec["model"]]
    batches = random_batches(cfg, spec["warmup"] + spec["steps"], spec["seed"] + 1, backend.device)
    baseline = _baseline_bytes(backend)
    model = build_model(cfg, row.dtype, backend.device, spec["seed"])
    opt = row.build(model)
    probe = GradProbe(list(model.parameters()))
    if row.release:
        qoptim.prepare_gradient_release(model, opt, grad_norms=row.grad_norms)
    losses = [train_step(model, opt, b, backend)[1] for b in batches[:spec["warmup"]]]
    states = optimizer_state_bytes(opt)
    parts = state_parts(opt)
    probe.remove()  # its sums over every parameter would add to the timed steps
    times: list[float] = []

    def run() -> None:
        for b in batches[spec["warmup"]:]:
            ms, loss = train_step(model, opt, b, backend)
            times.append(ms)
            losses.append(loss)

    if spec["phase"] == "time":
        run()
        return {"step_ms_each": times, "losses": losses}
    peak, method = _peak_bytes(backend, run)
    return {"numel": sum(p.numel() for p in model.parameters()),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "grad_bytes": probe.peak, "state_bytes": states, "baseline_bytes": baseline, "peak_bytes": peak,
            "method": method, "step_ms_each": times, "losses": losses, "state_parts": parts}


def child_main(spec_json: str) -> int:
    """Subprocess body: :func:`measure_in_child` on the JSON ``spec``; prints one marked JSON line
    (``{"error": ...}`` when the row cannot run)."""
    spec = json.loads(spec_json)
    warnings.simplefilter("ignore")
    try:
        out = measure_in_child(spec)
    except Exception as e:  # a row that cannot run here is a row with its error
        out = {"error": one_line(e)}
    print(_CHILD_MARK + json.dumps(out), flush=True)
    return 0


# -- the parent ------------------------------------------------------------------------------------------
def measure_row(row: MemoryRow, device: str, opts: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`child_main` for ``row`` on ``device`` in fresh interpreters; the raw result, or
    ``{"error": ...}`` when it fails. On the CPU two children train the same steps: the memory one
    under :data:`~qconf.bench.rss.CHILD_MALLOC_ENV` (freed memory goes back to the OS at once, so
    RSS follows the live bytes, at the price of a page fault per fresh allocation) and the timing
    one under glibc's default allocator, as users train (``step_ms_each`` comes from it;
    ``timing_losses_match`` says whether its losses equal the memory child's bit for bit)."""
    spec = {"key": row.key, "device": device, "model": opts.memory_model, "seed": opts.seed,
            "threads": opts.threads, "warmup": opts.memory_warmup, "steps": opts.memory_steps, "phase": "memory",
            "muon": bool(getattr(opts, "muon", False))}
    raw = run_child(_CHILD_CODE, _CHILD_MARK, spec, opts.rss_timeout)
    if "error" in raw or device != "cpu":
        return raw
    timed = run_child(_CHILD_CODE, _CHILD_MARK, {**spec, "phase": "time"}, opts.rss_timeout, malloc_env=False)
    if "error" in timed:
        return {"error": f"timing run: {timed['error']}"}
    return {**raw, "step_ms_each": timed["step_ms_each"], "timing_losses_match": timed["losses"] == raw["losses"]}


def unavailable(row: MemoryRow, device: str) -> str | None:
    """Why ``row`` cannot run on ``device`` (``"no CUDA"``, ``"not installed"``), or None."""
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA"
    if row.requires is not None and importlib.util.find_spec(row.requires) is None:
        return "not installed"
    return None


def attribute(raw: dict[str, Any]) -> tuple[dict[str, int], dict[str, float]]:
    """A child's raw numbers as ``(bytes, bytes per parameter)``, each keyed by :data:`FIELDS`."""
    params, grads, states = raw["param_bytes"], raw["grad_bytes"], raw["state_bytes"]
    peak = raw["peak_bytes"] - raw["baseline_bytes"]
    total = {"params": params, "grads": grads, "states": states, "other": peak - (params + grads + states),
             "params_grads_states": params + grads + states, "peak": peak}
    n = raw["numel"]
    per = {k: v / n for k, v in total.items()}
    per["params_grads_states"] = per["params"] + per["grads"] + per["states"]
    return total, per


def row_result(row: MemoryRow, device: str, raw: dict[str, Any] | None, status: str | None) -> dict[str, Any]:
    """The JSON row of ``row`` on ``device``: from the child's ``raw`` result, or with ``status``
    (``"no CUDA"``, ``"not installed"``) and no numbers."""
    r: dict[str, Any] = {"key": row.key, "name": row.name, "device": device,
                         "dtype": str(row.dtype).removeprefix("torch."), "family": row.family,
                         "gradient_release": row.release, "counterpart": row.counterpart, "status": "ok",
                         "error": None, "bytes": dict.fromkeys(FIELDS), "b_per_param": dict.fromkeys(FIELDS),
                         "step_ms": None, "final_loss": None, "loss_matches_counterpart": None,
                         "timing_losses_match": None}
    if status is not None:
        requires = row.requires if status == "not installed" else None
        return {**r, "status": status, "error": f"{requires} is not installed" if requires else status}
    if "error" in raw:
        return {**r, "status": "error", "error": raw["error"]}
    total, per = attribute(raw)
    times = raw["step_ms_each"]
    return {**r, "bytes": total, "b_per_param": per, "numel": raw["numel"], "method": raw["method"],
            "baseline_bytes": raw["baseline_bytes"], "step_ms": statistics.median(times), "step_ms_each": times,
            "losses": raw["losses"], "final_loss": raw["losses"][-1],
            "timing_losses_match": raw.get("timing_losses_match"), "state_parts": raw.get("state_parts")}


def compare_release(rows: list[dict[str, Any]]) -> None:
    """Set ``loss_matches_counterpart`` (final losses equal bit for bit), ``counterpart_final_loss``
    and ``step_time_ratio`` (its ms/step over the counterpart's) on every gradient-release row
    whose counterpart ran on the same device."""
    by_key = {(r["device"], r["key"]): r for r in rows}
    for r in rows:
        other = by_key.get((r["device"], r["counterpart"]))
        if r["status"] == "ok" and other is not None and other["status"] == "ok":
            r["counterpart_final_loss"] = other["final_loss"]
            r["loss_matches_counterpart"] = r["final_loss"] == other["final_loss"]
            r["step_time_ratio"] = r["step_ms"] / other["step_ms"]


def _log(opts: argparse.Namespace, msg: str) -> None:
    if not opts.quiet:
        print(msg, file=sys.stderr, flush=True)


def measure_device(device: str, rows: list[MemoryRow], opts: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row of ``rows`` on ``device``, each in its own child process (or with the status that
    says why it cannot run)."""
    out = []
    for row in rows:
        status = unavailable(row, device)
        raw = None
        if status is None:
            _log(opts, f"[memory {device}] {row.key}: child process ({opts.memory_warmup} warm-up + "
                       f"{opts.memory_steps} measured steps)")
            raw = measure_row(row, device, opts)
        r = row_result(row, device, raw, status)
        if r["status"] == "ok":
            _log(opts, f"[memory {device}] {row.key}: peak {r['b_per_param']['peak']:.2f} B/param, "
                       f"{r['step_ms']:.0f} ms/step, final loss {r['final_loss']:.6f}")
        out.append(r)
    compare_release(out)
    return out


def run_memory(opts: argparse.Namespace, command: str,
               on_event: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The whole memory benchmark on every device of ``opts.device`` (None: :data:`DEVICES`):
    the JSON-ready result. ``on_event("start", result)`` and ``on_event(device, result)`` report
    progress. ValueError for a ``--contenders`` pattern that matches no row."""
    devices = [opts.device] if opts.device else list(DEVICES)
    muon = bool(getattr(opts, "muon", False))
    chosen = {d: select_rows(roster(d, muon), opts.contenders) for d in devices}
    torch.set_num_threads(opts.threads)
    cfg = MODEL_PRESETS[opts.memory_model]
    machine = machine_info(opts.threads)
    machine["flashoptim"] = package_version("flashoptim")
    machine["gpu"] = cuda_info() if torch.cuda.is_available() else None
    result: dict[str, Any] = {
        "benchmark": "memory",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command, "devices": devices, "machine": machine,
        "settings": {"optimizer": "muon" if muon else "adamw", "model": opts.memory_model,
                     "model_config": dataclasses.asdict(cfg), "numel": cfg.numel,
                     "warmup": opts.memory_warmup, "steps": opts.memory_steps, "threads": opts.threads,
                     "seed": opts.seed, "lr": LR, "weight_decay": WEIGHT_DECAY, "child_malloc_env": CHILD_MALLOC_ENV,
                     "attribution": ATTRIBUTION},
        "rows": [],
    }
    if on_event is not None:
        on_event("start", result)
    for device in devices:
        result["rows"] += measure_device(device, chosen[device], opts)
        if on_event is not None:
            on_event(device, result)
    return result

