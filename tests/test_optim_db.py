"""torch's own optimizer test database (``optim_db``) run against qconf with quantization off.

For Adam, AdamW and SGD every optimizer input torch defines for the CPU -- its ``optim_inputs_func``
plus the variants with each implementation flag (``differentiable``, ``fused``) that
``_get_optim_inputs_including_global_cliquey_kwargs`` adds -- is run in float32 and float64: the
qconf optimizer under ``configs/fp32.yml`` and torch's on identical parameters and gradients for
a few steps, parameters compared with ``torch.testing.assert_close``'s default tolerance for the
dtype (torch's own). An input that sets an option qconf refuses must raise a clear error instead
(docs/optimizers.md, "Options qconf refuses"). torch's error inputs (``optim_error_inputs_func``)
must raise torch's error with torch's message, except where qconf's documented behaviour differs.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch

# torch.testing._internal imports expecttest (requirements-dev.txt); importing it also freezes
# torch.backends' global flags (torch.backends.disable_global_flags), which no qconf test sets
from torch.testing._internal.common_optimizers import (
    OptimizerErrorEnum, _get_optim_inputs_including_global_cliquey_kwargs, optim_db)

import qconf.optim

from helpers import CONFIGS

FP32 = CONFIGS / "fp32.yml"
NAMES = ("Adam", "AdamW", "SGD")
DTYPES = (torch.float32, torch.float64)
SHAPES = [(10, 5), (10,), (3, 2, 2)]
STEPS = 5
INFOS = {info.name: info for info in optim_db if info.name in NAMES}

#: options qconf refuses at construction: keyword -> what the ValueError says
REFUSED = {"amsgrad": "amsgrad=True is not supported", "capturable": "capturable=True",
           "differentiable": "differentiable=True is not supported"}

def _cases():
    for name in NAMES:
        for dtype in DTYPES:
            for i, inp in enumerate(_get_optim_inputs_including_global_cliquey_kwargs("cpu", dtype, INFOS[name])):
                refused = sorted(k for k in REFUSED if inp.kwargs.get(k))
                fused64 = dtype == torch.float64 and inp.kwargs.get("fused") is True
                yield pytest.param(name, dtype, inp.kwargs, refused, fused64,
                                   id=f"{name}-{str(dtype)[6:]}-{i}-{inp.desc.replace(' ', '_')}")


def _run(cls, kwargs, dtype):
    """Parameters after STEPS steps of fixed gradients."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]
    opt = cls(params, **kwargs)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
        opt.step()
    return params


@pytest.mark.parametrize("name, dtype, kwargs, refused, fused64", list(_cases()))
def test_optim_db_input(name, dtype, kwargs, refused, fused64):
    qconf_cls = getattr(qconf.optim, name)
    if refused:
        with pytest.raises(ValueError, match=re.escape(REFUSED[refused[0]])):
            qconf_cls([torch.nn.Parameter(torch.zeros(2, dtype=dtype))], **kwargs, qconfig=FP32)
        return
    if fused64:  # qconf's fused=True is its native kernel, which takes float32/bfloat16/float16
        refusal = rf"{name}\(fused=True\) cannot fuse: parameter 0 has dtype torch.float64"
        with pytest.raises(RuntimeError, match=refusal):
            _run(qconf_cls, {**kwargs, "qconfig": FP32}, dtype)
        return
    expected = _run(INFOS[name].optim_cls, kwargs, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to another path ...
        if dtype == torch.float64:  # ... except float64's documented one: the kernels take fp32/bf16/fp16
            warnings.filterwarnings("ignore", message=".*using the reference path for a param group because "
                                    "parameter 0 has dtype torch.float64", category=UserWarning)
        actual = _run(qconf_cls, {**kwargs, "qconfig": FP32}, dtype)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


#: error inputs that qconf accepts, with why, and the torch kwargs whose results it must give
ACCEPTED = {
    "lr as Tensor doesn't work with foreach & not capturable":
        ("foreach is accepted and ignored (qconf has no foreach implementation)", {"foreach": False}),
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True":  # (torch escapes the desc)
        ("foreach is accepted and ignored", {"foreach": False}),
}
#: error inputs where qconf raises something stricter than torch: desc -> (error type, message)
STRICTER = {"a param group cannot have duplicate parameters":  # torch only warns (deprecated)
            (ValueError, "param group 0 lists the same parameter twice")}


def _error_cases():
    for name in NAMES:
        for i, err in enumerate(INFOS[name].optim_error_inputs_func("cpu", torch.float32)):
            desc = err.optimizer_error_input.desc
            yield pytest.param(name, err, id=f"{name}-{i}-{desc.replace(' ', '_')}")


def _steps(opt, n):
    for step in range(n):
        g = torch.Generator().manual_seed(10 + step)
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.rand(p.shape, generator=g, dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("name, err", list(_error_cases()))
def test_optim_db_error_input(name, err):
    inp = err.optimizer_error_input
    qconf_cls = getattr(qconf.optim, name)
    params = inp.params if inp.params is not None else [torch.nn.Parameter(torch.randn(2, 2))]
    if inp.desc in ACCEPTED:
        ref = [p.detach().clone().requires_grad_() for p in params]
        _steps(qconf_cls(params, **inp.kwargs, qconfig=FP32), STEPS)
        _steps(INFOS[name].optim_cls(ref, **{**inp.kwargs, **ACCEPTED[inp.desc][1]}), STEPS)
        for a, e in zip(params, ref):
            torch.testing.assert_close(a, e)
        return
    steps = 1 if err.error_on == OptimizerErrorEnum.STEP_ERROR else 0
    if inp.desc in STRICTER:
        error_type, message = STRICTER[inp.desc]
        with pytest.raises(error_type, match=message):
            _steps(qconf_cls(params, **inp.kwargs, qconfig=FP32), steps)
        return
    if issubclass(err.error_type, Warning):
        with pytest.warns(err.error_type, match=err.error_regex):
            _steps(qconf_cls(params, **inp.kwargs, qconfig=FP32), steps)
    else:
        with pytest.raises(err.error_type, match=err.error_regex):
            _steps(qconf_cls(params, **inp.kwargs, qconfig=FP32), steps)


def test_capturable_is_refused_on_cpu_too():
    """torch lists capturable=True among its CUDA inputs only; qconf refuses it everywhere."""
    for name in ("Adam", "AdamW"):
        with pytest.raises(ValueError, match=re.escape(REFUSED["capturable"])):
            getattr(qconf.optim, name)([torch.nn.Parameter(torch.zeros(2))], capturable=True, qconfig=FP32)
