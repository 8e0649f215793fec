"""Constructor inputs the optimizers refuse: parameters of a dtype no rule can update (integer,
bool, ...; torch.optim accepts them and then fails or truncates every update to nothing), and
RNG seeds outside the rule ``load_state_dict`` applies to a checkpoint's seed."""
from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from qconf.optim import SGD, Adam, AdamW, Lion

from helpers import CONFIGS, assert_same_state, flat_state

FP32 = CONFIGS / "fp32.yml"

_MAKERS = {
    "AdamW": lambda ps, **kw: AdamW(ps, lr=1e-3, qconfig=FP32, fused=False, **kw),
    "Adam": lambda ps, **kw: Adam(ps, lr=1e-3, qconfig=FP32, fused=False, **kw),
    "SGD": lambda ps, **kw: SGD(ps, lr=0.05, momentum=0.9, qconfig=FP32, fused=False, **kw),
    "Lion": lambda ps, **kw: Lion(ps, lr=1e-3, qconfig=FP32, fused=False, **kw),
}
_ALLOWED = "torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64 or torch.complex128"
_BAD_DTYPES = [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.complex32]
_GOOD_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.complex128]


def _dtype_error(rule: str, where: str, group: int, dtype: torch.dtype) -> str:
    """The exact message for a refused parameter, as a regex."""
    return re.escape(f"{rule}: {where} of param group {group} has dtype {dtype}, which cannot be optimized; "
                     f"parameters must be {_ALLOWED}")


def _ones(dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32: "ComplexHalf support is experimental"
        return torch.ones(n, dtype=torch.float32).to(dtype)


# -- parameter dtypes ------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", list(_MAKERS))
@pytest.mark.parametrize("dtype", _BAD_DTYPES, ids=str)
def test_constructor_refuses_non_float_parameters(rule, dtype):
    with pytest.raises(ValueError, match=_dtype_error(rule, "parameter 1", 0, dtype)):
        _MAKERS[rule]([torch.zeros(4), _ones(dtype)])


def test_int_parameter_with_a_gradient_is_refused_before_any_step():
    """The issue's case: AdamW took an int32 parameter and its step left it unchanged."""
    p = torch.zeros(3, dtype=torch.int32)
    p.grad = torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=_dtype_error("AdamW", "parameter 0", 0, torch.int32)):
        AdamW([p], lr=0.1)


def test_refusal_names_the_parameter_and_its_group():
    named = [("w", torch.zeros(4)), ("mask", _ones(torch.bool))]
    with pytest.raises(ValueError, match=_dtype_error("SGD", "parameter 1 ('mask')", 0, torch.bool)):
        _MAKERS["SGD"](named)
    groups = [{"params": [torch.zeros(2), torch.zeros(3)]}, {"params": [("b", torch.zeros(2)), ("idx", _ones(torch.int64))]}]
    with pytest.raises(ValueError, match=_dtype_error("Lion", "parameter 3 ('idx')", 1, torch.int64)):
        _MAKERS["Lion"](groups)


@pytest.mark.parametrize("rule", list(_MAKERS))
@pytest.mark.parametrize("dtype", _BAD_DTYPES[:5], ids=str)
def test_add_param_group_refuses_and_leaves_the_optimizer_unchanged(rule, dtype):
    p = torch.randn(5, requires_grad=True)
    opt = _MAKERS[rule]([("w", p)])
    p.grad = torch.randn(5)
    opt.step()
    before, groups_before = flat_state(opt), copy.deepcopy(opt.state_dict()["param_groups"])
    with pytest.raises(ValueError, match=_dtype_error(rule, "parameter 2 ('bad')", 1, dtype)):
        opt.add_param_group({"params": [("ok", torch.zeros(3)), ("bad", _ones(dtype))]})
    assert_same_state(before, flat_state(opt))
    assert opt.state_dict()["param_groups"] == groups_before and len(opt.param_groups) == 1
    opt.add_param_group({"params": [("ok", torch.zeros(3, requires_grad=True))]})  # still usable
    assert opt.param_name(1) == "ok"
    opt.step()


@pytest.mark.parametrize("rule", list(_MAKERS))
@pytest.mark.parametrize("dtype", _GOOD_DTYPES, ids=str)
def test_float_and_complex_parameters_still_step(rule, dtype):
    p = torch.randn(8, dtype=torch.float64).to(dtype) if not dtype.is_complex else torch.randn(8, dtype=dtype)
    p.requires_grad_()
    before = p.detach().clone()
    opt = _MAKERS[rule]([p])
    p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(p.detach(), before)


# -- seed ------------------------------------------------------------------------------------------
_BAD_SEEDS = [-1, 1.5, 2**70, 2**64, True, False, 3.0, "7", torch.tensor(3)]


@pytest.mark.parametrize("rule", list(_MAKERS))
@pytest.mark.parametrize("seed", _BAD_SEEDS, ids=repr)
def test_constructor_refuses_bad_seeds(rule, seed):
    message = f"seed must be None (torch.initial_seed()) or an int in [0, 2**64), got {seed!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        _MAKERS[rule]([torch.zeros(3)], seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**63, 2**64 - 1])
def test_constructor_keeps_good_seeds(seed):
    opt = _MAKERS["AdamW"]([torch.zeros(3)], seed=seed)
    assert opt._seed == seed
    assert opt.state_dict()["param_groups"][0]["qconf"]["seed"] == seed


def test_seed_none_takes_torch_initial_seed():
    with torch.random.fork_rng():  # the global generator is left as it was
        torch.manual_seed(2**64 - 5)
        assert _MAKERS["SGD"]([torch.zeros(3)])._seed == torch.initial_seed() == 2**64 - 5


@pytest.mark.parametrize("seed", [*_BAD_SEEDS, 0, 7, 2**64 - 1], ids=repr)
def test_constructor_and_load_state_dict_apply_one_seed_rule(seed):
    """A seed the constructor refuses is refused in a checkpoint too, and the other way round."""
    sd = _MAKERS["AdamW"]([torch.zeros(3)]).state_dict()
    sd["param_groups"][0]["qconf"]["seed"] = seed
    target = _MAKERS["AdamW"]([torch.zeros(3)], seed=1)
    try:
        _MAKERS["AdamW"]([torch.zeros(3)], seed=seed)
    except ValueError:
        with pytest.raises(ValueError, match=re.escape(f"'qconf.seed' must be an int in [0, 2**64), got {seed!r}")):
            target.load_state_dict(sd)
        assert target._seed == 1
    else:
        target.load_state_dict(sd)
        assert target._seed == seed
