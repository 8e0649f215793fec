"""Run keys: a hash of everything that determines a run's numbers.

A run is (task, config, optimizer and its arguments, seed, steps, ...). Its key is the SHA-256 of
the canonical JSON of:

* ``shared``: the task (name, how it was named on the command line, description, ``info`` --
  the built-in tasks record their data's hash there -- and the schedule's name), steps,
  eval_every, the kernel that runs the step (native or reference), torch's thread count, whether
  the fp32 shadow measures state errors, qconf's and torch's versions;
* ``row``: what the config and optimizer *resolve to* on the task's model: for every parameter its
  name, shape and dtype, every state the optimizer keeps for it with the codec that stores it (or
  none), the weights policy of low-precision parameters and the BitNet section when enabled; the
  optimizer's class and effective hyperparameters, its extra arguments and the learning rate;
* the seed.

Resolving first is what makes points that differ only in a field without effect (``group_size``
under a rank-1 or tensor scale, ``weights.rounding`` with fp32 parameters, ``exp_avg_sq`` for
SGD, a ``min_numel`` between two parameter sizes) one run: the same key, run once, stored once.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Mapping

import torch

from .. import __version__, _native
from ..codec import Codec
from ..codec.scales import effective_scale
from ..config import QConfig
from ..nn import quantize_
from ..optim.weights import LOW_PRECISION
from .runner import make_optimizer
from .task import Task

KEY_FORMAT = 1


def plain(x: Any) -> Any:
    """``x`` as JSON-ready plain data: tuples become lists, dtypes and other objects their str."""
    if isinstance(x, Mapping):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def digest(data: Any) -> str:
    """SHA-256 (hex) of the canonical JSON of ``data`` (sorted keys, no spaces)."""
    text = json.dumps(plain(data), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def task_identity(task: Task, spec: str | None) -> dict[str, Any]:
    """What identifies a task's numbers: its name, spec, description, info and schedule."""
    schedule = task.lr_schedule
    return {"name": task.name, "spec": spec, "description": task.description, "info": plain(task.info),
            "lr_schedule": None if schedule is None else getattr(schedule, "__qualname__", repr(schedule))}


def kernel_name(fused: bool | None) -> str:
    """The step that runs: ``native`` (the fused kernels) or ``reference``."""
    return "native" if fused is not False and _native.fused_available() else "reference"


def shared_identity(task: Task, spec: str | None, *, steps: int, eval_every: int, fused: bool | None,
                    threads: int, measure_error: bool) -> dict[str, Any]:
    """The part of every run's key that the whole study shares."""
    return {"format": KEY_FORMAT, "task": task_identity(task, spec), "steps": steps, "eval_every": eval_every,
            "kernel": kernel_name(fused), "threads": threads, "measure_error": measure_error,
            "qconf": __version__, "torch": torch.__version__}


def _codec_identity(codec: Codec | None, shape: tuple[int, ...]) -> Any:
    """A codec as it acts on a state of ``shape``: the effective scale type, and the group size only
    where blocks exist (``group``, and ``rank1`` on 1-D states)."""
    if codec is None:
        return None
    d = codec.to_dict()
    d["scale"] = effective_scale(codec.scale, tuple(shape)) if len(shape) else codec.scale
    if d["scale"] != "group":
        del d["group_size"]
    return d


def row_identity(named: list[tuple[str, torch.nn.Parameter]], config: QConfig, optimizer: str, lr: float,
                 kwargs: Mapping[str, Any], fused: bool | None) -> dict[str, Any]:
    """What ``config`` and ``optimizer`` resolve to on the parameters ``named`` (see the module
    docstring). Builds the optimizer (no state is allocated)."""
    opt = make_optimizer(optimizer, named, lr=lr, qconfig=config, fused=fused, kwargs=dict(kwargs))
    group = opt.param_groups[0]
    params = []
    for index, (name, p) in enumerate(named):
        states = [[spec.key, list(spec.shape), str(spec.dtype), _codec_identity(codec, spec.shape)]
                  for spec, codec in opt.planned_states(index)]
        weights = opt.plan(index).weights.to_dict() if p.dtype in LOW_PRECISION else None
        params.append([name, list(p.shape), str(p.dtype), states, weights])
    return {"optimizer": type(opt).__qualname__,
            "hyper": {k: v for k, v in group.items() if k not in ("params", "param_names")},
            "kwargs": dict(kwargs), "params": params,
            "bitnet": config.bitnet.to_dict() if config.bitnet.enable else None}


def model_parameters(task: Task, seed: int, config: QConfig) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters of the task's model as a run builds it (BitNet layers converted
    when the config enables them: their latent dtype may differ)."""
    model = task.make_model(seed)
    if config.bitnet.enable:
        quantize_(model, config)
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def run_key(shared_digest: str, row_digest: str, seed: int) -> str:
    """The run's key: 24 hex digits of the hash of the shared and row digests and the seed."""
    return digest({"shared": shared_digest, "row": row_digest, "seed": seed})[:24]
