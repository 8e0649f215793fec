"""Property tests: ``load_state_dict`` on randomly corrupted checkpoints (seeded, bounded).

A valid state dict -- qconf's own or torch.optim's -- is mutated at random places: values replaced
by other types, NaN/inf/negative/huge numbers, tensors of another dtype or shape, codes and scales
poisoned, keys dropped or added, containers swapped. Whatever comes in, ``load_state_dict`` either
loads it or raises ``ValueError`` (never another exception); a refused checkpoint leaves the
optimizer bitwise unchanged, and after a successful load one step from finite gradients produces
no NaN.

Finite poison values stay moderate (up to 1e6 times the original): a checkpoint whose valid values
overflow float32 inside the update rule itself (say a state of 1e38 with lr=0 gives inf*0) is as
broken in torch.optim and is not what validation is for.
"""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from qconf.optim import SGD, AdamW, Lion

from helpers import flat_state

pytestmark = pytest.mark.filterwarnings("ignore:Casting complex values to real:UserWarning")
TRIALS = 60  # per setup; the whole file stays well under 40 s on a loaded 2-core machine
SMALL_CFG = {"min_numel": 64,
             "states": {"exp_avg": {"rounding": "stochastic"},
                        "exp_avg_sq": {"map": "power-1", "signed": False, "scale": "rank1"}}}
# signed maps everywhere: a signed linear first moment (its top code is outside the map) and a
# signed second moment (negative values decode from it)
SIGNED_CFG = {"min_numel": 64,
              "states": {"exp_avg": {"map": "linear", "signed": True, "bits": 4},
                         "exp_avg_sq": {"map": "nonlinear", "signed": True, "bits": 8, "scale": "group",
                                        "group_size": 32}}}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


SETUPS = {
    "adamw-4bit": (lambda ps: AdamW(ps, lr=1e-3, qconfig=SMALL_CFG, seed=1), None),
    "adamw-signed-fused": (lambda ps: AdamW(ps, lr=1e-3, qconfig=SIGNED_CFG, seed=1, fused=None), None),
    "adamw-factored": (lambda ps: AdamW(ps, lr=1e-3, qconfig=SMALL_CFG, factor_second_moment=True, seed=1), None),
    "sgd-nesterov": (lambda ps: SGD(ps, lr=0.01, momentum=0.9, nesterov=True, qconfig=SMALL_CFG, seed=1), None),
    "lion": (lambda ps: Lion(ps, lr=1e-4, qconfig=SMALL_CFG, seed=1), None),
    "torch-adamw": (lambda ps: AdamW(ps, lr=1e-3, qconfig=SMALL_CFG, seed=1),
                    lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "torch-sgd": (lambda ps: SGD(ps, lr=0.01, momentum=0.9, qconfig=SMALL_CFG, seed=1),
                  lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)),
}

# -- random mutations ---------------------------------------------------------------------------
_DELETE = object()
_WEIRD = [lambda: None, lambda: "x", lambda: 1, lambda: -1, lambda: 0, lambda: 2**70, lambda: 1.5,
          lambda: math.nan, lambda: math.inf, lambda: -math.inf, lambda: True, lambda: [], lambda: {},
          lambda: [1, 2], lambda: (0.9,), lambda: torch.tensor(math.nan), lambda: torch.zeros(3),
          lambda: torch.zeros(2, 2, dtype=torch.int64), lambda: {"codes": 1}, lambda: b"\x00"]
_POISON = [math.nan, math.inf, -math.inf, -1.0, -1e-3, 0.0, 1e6]


def _mutate_tensor(rng: random.Random, t: torch.Tensor):
    op = rng.randrange(5)
    if op == 0 and t.numel() > 0:  # poison a few elements
        t = t.clone()
        flat = t.view(-1)
        for _ in range(rng.choice([1, 1, 2, 3])):
            i = rng.randrange(flat.numel())
            if t.dtype == torch.uint8:
                flat[i] = rng.randrange(256)
            elif t.is_floating_point():
                flat[i] = rng.choice(_POISON)
            else:
                flat[i] = rng.choice([-1, 2**31 - 1])
        return t
    if op == 1:
        return t.to(rng.choice([torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool,
                                torch.complex64]))
    if op == 2:
        shapes = [lambda: t.reshape(-1), lambda: t.unsqueeze(0), lambda: torch.zeros(0, dtype=t.dtype)]
        if t.dim() > 0 and t.shape[-1] > 0:
            shapes.append(lambda: t[..., :-1])
        return rng.choice(shapes)()
    if op == 3 and (t.is_floating_point() or t.dtype == torch.uint8):
        return (t * rng.choice([-1, 0, 1e6])).to(t.dtype) if t.is_floating_point() else t ^ 0xFF
    return rng.choice(_WEIRD)()


def _mutate_value(rng: random.Random, v):
    if rng.random() < 0.15:
        return _DELETE
    if isinstance(v, torch.Tensor) and rng.random() < 0.8:
        return _mutate_tensor(rng, v)
    if isinstance(v, bool) and rng.random() < 0.6:
        return rng.choice([not v, int(v), "True"])
    if isinstance(v, (int, float)) and not isinstance(v, bool) and rng.random() < 0.7:
        return rng.choice([-v, v * 1e6, math.nan, math.inf, v + 1, 0, str(v), -1])
    if isinstance(v, dict) and rng.random() < 0.5:
        v = dict(v)
        if rng.random() < 0.5:
            v[rng.choice(["extra", "max_exp_avg_sq", 99, "step", "momentum_buffer"])] = rng.choice(_WEIRD)()
            return v
        return list(v.values())
    if isinstance(v, list) and rng.random() < 0.5:
        return rng.choice([tuple(v), dict(enumerate(v)), v + [rng.choice(_WEIRD)()], v[:-1]])
    return rng.choice(_WEIRD)()


def _random_path(rng: random.Random, obj) -> tuple:
    """A random walk from the root into the nested dicts/lists of ``obj`` (tuples were made
    lists), stopping below the top level with probability 1/4 per level (1/10 at the top-level
    keys): every part of a state dict gets its share, however many leaves it has (a qconfig has
    many)."""
    path: tuple = ()
    while isinstance(obj, (dict, list)) and len(obj):
        if path and rng.random() < (0.1 if len(path) == 1 else 0.25):
            break
        key = rng.choice(list(obj.keys()) if isinstance(obj, dict) else range(len(obj)))
        path, obj = path + (key,), obj[key]
    return path


def _lists(obj):
    if isinstance(obj, dict):
        return {k: _lists(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_lists(v) for v in obj]
    return obj


def _mutate(rng: random.Random, sd: dict):
    """1 to 3 random mutations of a deep copy of ``sd``; returns it and a description."""
    sd = _lists(copy.deepcopy(sd))
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        path = _random_path(rng, sd) if rng.random() >= 0.03 else ()
        if not path:
            if rng.random() < 0.2:
                return rng.choice([[], None, "sd", list(sd.items())]), done + ["<root>"]
            continue
        parent = sd
        for k in path[:-1]:
            parent = parent[k]
        new = _mutate_value(rng, parent[path[-1]])
        if new is _DELETE:
            del parent[path[-1]]
            done.append(f"del {path}")
        else:
            parent[path[-1]] = new
            done.append(f"{path} = {type(new).__name__}")
    return sd, done


# -- the property --------------------------------------------------------------------------------
def _assert_same_bits(a: dict, b: dict, context) -> None:
    """``flat_state`` snapshots equal bit for bit (NaN equals NaN: a group key the optimizer
    accepted earlier, as torch keeps unknown keys, may hold one)."""
    assert a.keys() == b.keys(), context
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, (context, k)
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (context, k)
        else:
            same_nan = isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
            assert type(x) is type(y) and (same_nan or x == y), (context, k)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_corrupt_checkpoints_load_or_raise_value_error(setup):
    make, make_source = SETUPS[setup]
    src_model = _model()
    src = (make_source or make)(src_model.parameters())
    _train(src_model, src, 2, seed=1)
    good = src.state_dict()

    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = make(model.parameters())
    _train(model, opt, 1, seed=2)
    rng = random.Random(f"qconf-checkpoint-fuzz-{setup}")
    grads = torch.Generator().manual_seed(3)
    outcomes = {"loaded": 0, "refused": 0}
    for trial in range(TRIALS):
        bad, what = _mutate(rng, good)
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), start):
                p.copy_(p0)
        before = flat_state(opt)  # every state and every param-group key, as state_dict() gives them
        try:
            opt.load_state_dict(bad)
        except ValueError as e:
            outcomes["refused"] += 1
            assert "the optimizer was left unchanged" in str(e), (trial, what, str(e))
            _assert_same_bits(before, flat_state(opt), (trial, what))
            continue
        except Exception as e:  # noqa: BLE001 -- the property under test: nothing but ValueError
            pytest.fail(f"trial {trial} ({what}): {type(e).__name__}: {e}")
        outcomes["loaded"] += 1
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=grads) * 0.1
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"trial {trial} ({what}): loaded, then step raised {type(e).__name__}: {e}")
        for p in model.parameters():
            assert not torch.isnan(p).any(), f"trial {trial} ({what}): NaN after one step"
    assert outcomes["loaded"] >= 3 and outcomes["refused"] >= 10, outcomes  # both paths exercised
