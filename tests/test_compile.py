"""torch.compile of steps that contain a qconf optimizer step gives the eager results.

Two ways users compile: a whole training step (forward, backward, ``opt.step()``), where a
reference-path step runs eagerly behind one graph break, and ``torch.compile(opt.step,
fullgraph=True)`` on the fused path, where the native op is traced with no graph break (the plan
is built by ``_init_group``, which Dynamo runs eagerly while tracing). Each run is compared with
the same run in eager mode on an identical copy: every parameter and every state tensor after a
few steps, bit for bit (both paths are deterministic).

Compilation is slow on a small machine, so the cases are few and the models small. The
``aot_eager`` backend keeps the forward/backward graphs' float operations equal to eager's (so
the gradients, and with them the whole run, are bit-identical); one case compiles the optimizer
step alone with the default Inductor backend.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing

from qconf import _native
from qconf.optim import SGD, Adam, AdamW, Lion, Muon

from helpers import assert_same_state, flat_state

FP32 = {"states": {"exp_avg": {"enable": False}, "exp_avg_sq": {"enable": False}}}  # configs/fp32.yml as a dict
STEPS = 3

needs_fused = pytest.mark.skipif(not _native.fused_available(), reason=f"fused kernels: {_native.native_error()}")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(seed=0, dtype=torch.float32):
    """80x64 = 5120 elements: quantized under the default min_numel (4096); the rest are not."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 4)).to(dtype)


def _train_step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _set_grads(model, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _assert_runs_equal(model_a, opt_a, model_b, opt_b):
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b), (a - b).abs().max()
    assert_same_state(flat_state(opt_a), flat_state(opt_b))


def _compare_training(make, dtype=torch.float32):
    """STEPS training steps eagerly and under torch.compile (aot_eager) on identical copies."""
    eager_model = _model(dtype=dtype)
    comp_model = copy.deepcopy(eager_model)
    eager_opt, comp_opt = make(eager_model), make(comp_model)
    compiled = torch.compile(_train_step, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(16, 64, generator=g).to(dtype)
        _train_step(eager_model, eager_opt, x)
        compiled(comp_model, comp_opt, x)
    _assert_runs_equal(eager_model, eager_opt, comp_model, comp_opt)


@pytest.mark.parametrize("make", [
    lambda m: AdamW(m.parameters(), lr=1e-2, fused=False),
    lambda m: SGD(m.parameters(), lr=1e-2, momentum=0.9, qconfig=FP32, fused=False),
    pytest.param(lambda m: AdamW(m.parameters(), lr=1e-2, fused=True), marks=needs_fused),
    lambda m: Muon(m.named_parameters(), lr=0.02, adamw={"lr": 1e-2}, fused=False),
    pytest.param(lambda m: Muon(m.named_parameters(), lr=0.02, adamw={"lr": 1e-2}, fused=True), marks=needs_fused),
], ids=["adamw-default-reference", "sgd-fp32-reference", "adamw-default-fused", "muon-default-reference",
        "muon-default-fused"])
def test_compiled_training_step_matches_eager(make):
    """Item 8(a): with fused=False this failed with a fake-tensor broadcast error after the
    per-parameter .item() graph break (Dynamo reused a resumed frame compiled for another
    parameter's state)."""
    _compare_training(make)


@needs_fused
def test_compiled_training_step_with_an_unfusable_group_matches_eager():
    """fused=None: a float64 group takes the reference path (eagerly, with the usual warning),
    the float32 group the traced fused op."""
    def make(m):
        return AdamW([{"params": [m[0].weight, m[0].bias]},
                      {"params": [m[2].weight.data.double().requires_grad_()]}], lr=1e-2)

    with pytest.warns(UserWarning, match="using the reference path for a param group"):
        _compare_training(make)


def _fused_runs(make, step_fn, on_step=None):
    """(model, optimizer) after STEPS steps of fixed gradients, stepping with ``step_fn(opt)``."""
    model = _model()
    opt = make(model)
    for step in range(STEPS):
        _set_grads(model, step)
        if on_step is not None:
            on_step(step, model, opt)
        step_fn(opt)
    return model, opt


def _compiled(backend, fullgraph=True):
    """A step_fn that compiles ``opt.step`` on first use."""
    holder = {}

    def step_fn(opt):
        if "f" not in holder:
            holder["f"] = torch.compile(opt.step, fullgraph=fullgraph, backend=backend)
        holder["f"]()

    return step_fn


RULES = {
    "adamw-default": lambda m: AdamW(m.parameters(), lr=1e-2, fused=True),
    "adam-fp32-two-groups": lambda m: Adam([{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 3e-3}],
                                           lr=1e-2, weight_decay=0.1, qconfig=FP32, fused=True),
    "sgd-default": lambda m: SGD(m.parameters(), lr=1e-2, momentum=0.9, dampening=0.1, fused=True),
    "lion-default": lambda m: Lion(m.parameters(), lr=1e-3, weight_decay=0.1, fused=True),
}


@needs_fused
@pytest.mark.parametrize("rule", sorted(RULES))
def test_fullgraph_fused_step_matches_eager(rule):
    """Item 8(b): torch.compile(opt.step, fullgraph=True) failed on a closure cell in the
    fusability check. It now compiles once per layout: SGD twice, because its first step starts
    the momentum buffer (a plan for that step only)."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    eager = _fused_runs(RULES[rule], lambda opt: opt.step())
    comp = _fused_runs(RULES[rule], _compiled(counter))
    _assert_runs_equal(*eager, *comp)
    assert counter.frame_count == (2 if rule.startswith("sgd") else 1)


def _muon(fused):
    """Muon for both weights (80x64: its momentum 4-bit under the default qconfig; 4x80: fp32), the
    AdamW part for the biases."""
    return lambda m: Muon(m.named_parameters(), lr=0.02, adamw={"lr": 1e-2}, seed=3, fused=fused)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_fused)])
def test_compiled_muon_step_matches_eager(fused):
    """torch.compile(opt.step) of a Muon hybrid: the Muon groups step outside the graph (their
    Newton–Schulz is host-driven), the AdamW part as any qconf group; the run is eager's bit for
    bit. fullgraph=True cannot hold the Muon groups and says so (it changes no parameter)."""
    make = _muon(fused)
    eager = _fused_runs(make, lambda opt: opt.step())
    comp = _fused_runs(make, _compiled("aot_eager", fullgraph=False))
    assert comp[1].routing() == {"0.weight": "muon", "2.weight": "muon", "0.bias": "adamw", "2.bias": "adamw"}
    _assert_runs_equal(*eager, *comp)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    _set_grads(model, 0)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="_muon_group|_reference_group"):
        torch.compile(make(model).step, fullgraph=True, backend="aot_eager")()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@needs_fused
def test_fullgraph_fused_step_with_inductor_matches_eager():
    make = RULES["adamw-default"]
    _assert_runs_equal(*_fused_runs(make, lambda opt: opt.step()), *_fused_runs(make, _compiled("inductor")))


@needs_fused
def test_compiled_step_follows_state_changes_between_steps():
    """A graph is guarded on the layout its plan describes: states converted by
    override_quantize_enable or replaced by load_state_dict between steps are the ones stepped."""
    def on_step(step, model, opt):
        if step == 1:
            opt.override_quantize_enable(model[0], "weight", False)
        if step == 2:
            opt.load_state_dict(opt.state_dict())

    make = RULES["adamw-default"]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    eager = _fused_runs(make, lambda opt: opt.step(), on_step)
    comp = _fused_runs(make, _compiled(counter), on_step)
    _assert_runs_equal(*eager, *comp)
    assert counter.frame_count == 3


@needs_fused
def test_compiled_fused_true_names_what_it_cannot_fuse():
    p = torch.nn.Parameter(torch.randn(10, dtype=torch.float64))
    p.grad = torch.randn_like(p)
    opt = AdamW([p], fused=True)
    with pytest.raises(RuntimeError, match=r"AdamW\(fused=True\) cannot fuse: parameter 0 has dtype torch.float64"):
        torch.compile(opt.step, fullgraph=True, backend="aot_eager")()
    assert not opt.state  # refused before any state was created


def test_a_compiled_step_with_host_groups_still_traces_the_fused_groups():
    """Muon's matrices (and reference-path groups) step outside the graph; the graph break must
    not make Dynamo skip the whole step: the AdamW part's fused op is in the traced graph."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _fused_runs(_muon(True), _compiled(backend, fullgraph=False))
    ops = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.qconf.fused_step in ops
