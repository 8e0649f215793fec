"""The CUDA fused step against the CPU fused step and the reference path (needs a CUDA GPU).

Same parameters, same gradients, 20 steps, for every shipped config plus a few synthetic ones that
reach the other code paths (stochastic rounding, tensor/dim0/dim1 scales, odd widths and group
sizes, 3-D and 4-D parameters, tiny tensors), fp32 and bf16 parameters, SGD/Adam/AdamW/Lion and the
factored second moment:

* CUDA vs CPU fused: identical codes, scales, fp32 states and parameters (bit for bit: both
  drivers run the element math of csrc/include/qconf/element.h in the same order);
* CUDA vs reference: identical codes and parameters within 1e-6 relative; with a factored
  second moment the statistics are summed in another order, so a code may be off by one where a
  value sits on a midpoint.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from qconf.codec import QTensor
from qconf.optim import SGD, Adam, AdamW, Lion
from qconf.optim.fused import hyper_values

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
STEPS = 20

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _state(bits=4, map="nonlinear", signed=True, scale="group", group_size=128, rounding="nearest"):
    return {"enable": True, "bits": bits, "map": map, "signed": signed, "scale": scale, "group_size": group_size,
            "rounding": rounding}


# configs beyond the shipped ones: the other scale kinds, rounding modes and code widths
EXTRA_CONFIGS = {
    "stochastic": {"min_numel": 64, "states": {
        "exp_avg": _state(rounding="stochastic"),
        "exp_avg_sq": _state(map="power-1", signed=False, scale="rank1", rounding="stochastic")}},
    "tensor_dim0": {"min_numel": 64, "states": {
        "exp_avg": _state(bits=3, scale="tensor"),
        "exp_avg_sq": _state(bits=5, map="power-2", signed=False, scale="dim0")}},
    "dim1_odd_groups": {"min_numel": 64, "states": {
        "exp_avg": _state(bits=7, scale="dim1", rounding="stochastic"),
        "exp_avg_sq": _state(bits=6, map="power-1", signed=False, group_size=100)}},
    "tiny_groups": {"min_numel": 0, "states": {
        "exp_avg": _state(bits=2, map="linear", signed=False, group_size=3),
        "exp_avg_sq": _state(bits=1, map="power-1", signed=False, group_size=5000)}},
}

CASES = [c.name for c in sorted(CONFIGS.glob("*.yml"))] + sorted(EXTRA_CONFIGS)

OPTIMIZERS = {
    "sgd": lambda ps, cfg, fused: SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, qconfig=cfg,
                                      fused=fused, seed=3),
    "adam": lambda ps, cfg, fused: Adam(ps, lr=2e-3, weight_decay=0.01, qconfig=cfg, fused=fused, seed=3),
    "adamw": lambda ps, cfg, fused: AdamW(ps, lr=3e-3, weight_decay=0.05, qconfig=cfg, fused=fused, seed=3),
    "lion": lambda ps, cfg, fused: Lion(ps, lr=1e-3, weight_decay=0.1, qconfig=cfg, fused=fused, seed=3),
    "adamw_factored": lambda ps, cfg, fused: AdamW(ps, lr=3e-3, factor_second_moment=True, qconfig=cfg,
                                                   fused=fused, seed=3),
}

SHAPES = [(96, 64), (96,), (16, 12, 5, 5), (4099,), (3, 40, 70), (7, 3)]


def _config(name):
    return CONFIGS / name if name.endswith(".yml") else EXTRA_CONFIGS[name]


def _params(dtype, device, shapes=SHAPES):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in shapes]


def _grads(step, dtype, shapes=SHAPES):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * 0.1).to(dtype) for s in shapes]


@pytest.fixture
def allow_cuda_fusion(monkeypatch):
    """Let the fused path take CUDA parameters even if the build lists only CPU kernels."""
    import qconf.optim.base
    import qconf.optim.fused

    original = qconf.optim.fused.unfusable_reason

    def reason(p):
        r = original(p)
        return None if r is not None and r.startswith("device") and p.is_cuda else r

    monkeypatch.setattr(qconf.optim.fused, "unfusable_reason", reason)
    monkeypatch.setattr(qconf.optim.base, "unfusable_reason", reason)


# gradient elements set at step 1 by run(..., poison=True): NaN, +-Inf, and a finite value whose
# square overflows fp32 (flat indices, where the tensor has them)
POISON = {3: float("nan"), 50: float("inf"), 51: -float("inf"), 99: 3e19}


def run(opt_name, config, dtype, device, fused, steps=STEPS, shapes=SHAPES, poison=False):
    params = _params(dtype, device, shapes)
    opt = OPTIMIZERS[opt_name](params, _config(config), fused)
    for step in range(steps):
        for p, gr in zip(params, _grads(step, dtype, shapes)):
            if poison and step == 1:
                for i, v in POISON.items():
                    if i < gr.numel():
                        gr.view(-1)[i] = v
            p.grad = gr.to(device)
        opt.step()
    return params, opt


def _states(opt):
    out = {}
    for i, (_, p, _) in enumerate(opt._named_params()):
        for k, v in opt.state[p].items():
            if isinstance(v, QTensor):
                out[(i, k, "codes")] = v.codes.cpu()
                out[(i, k, "scales")] = v.scales.cpu()
            elif isinstance(v, torch.Tensor):
                out[(i, k)] = v.detach().cpu()
    return out


def assert_identical(params_a, opt_a, params_b, opt_b):
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), f"parameter {i}"
    sa, sb = _states(opt_a), _states(opt_b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _codes(q: QTensor) -> torch.Tensor:
    from qconf.codec import packing

    return packing.unpack(q.codes.cpu(), q.codec.bits, q.numel()).to(torch.int64)


def assert_close_to_reference(params, opt, params_ref, opt_ref, factored):
    """Parameters within 1e-6 relative (of the tensor's magnitude); codes identical, or off by one
    with a factored second moment (its statistics are summed in another order)."""
    for i, (a, b) in enumerate(zip(params, params_ref)):
        a, b = a.detach().cpu().float(), b.detach().cpu().float()
        err = (a - b).abs().max().item()
        assert err <= 1e-6 * b.abs().max().item(), f"parameter {i}: max abs diff {err:.3e}"
        if not factored:
            assert torch.equal(a, b), f"parameter {i}"
    for (_, p, _), (_, q, _) in zip(opt._named_params(), opt_ref._named_params()):
        for k, v in opt.state[p].items():
            ref = opt_ref.state[q][k]
            if isinstance(v, QTensor):
                diff = (_codes(v) - _codes(ref)).abs()
                assert diff.max().item() <= (1 if factored else 0), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("config", CASES)
def test_cuda_matches_cpu_fused_and_reference(config, opt_name, dtype, allow_cuda_fusion):
    cuda_params, cuda_opt = run(opt_name, config, dtype, "cuda", True)
    cpu_params, cpu_opt = run(opt_name, config, dtype, "cpu", True)
    assert_identical(cuda_params, cuda_opt, cpu_params, cpu_opt)
    ref_params, ref_opt = run(opt_name, config, dtype, "cpu", False)
    assert_close_to_reference(cuda_params, cuda_opt, ref_params, ref_opt, opt_name.endswith("factored"))


# Larger tensors for the paths the small ones miss: several chunks per two-pass tensor, more
# absmax slots than fit in shared memory (device atomics instead), single-pass groups promoted to
# two passes on the GPU, blocks larger than a chunk, zero-size parameters.
RARE_SHAPES = [(4, 20000), (16000,), (50001,), (0, 5), (3, 7, 2000), (20000, 3)]
RARE_CONFIGS = {
    "big_group_rank1": {"min_numel": 0, "states": {
        "exp_avg": _state(group_size=16384),
        "exp_avg_sq": _state(map="power-1", signed=False, scale="rank1", rounding="stochastic")}},
    "promote": {"min_numel": 0, "states": {
        "exp_avg": _state(bits=3, group_size=1),
        "exp_avg_sq": _state(bits=4, map="power-1", signed=False, group_size=15999)}},
    "huge_blocks": {"min_numel": 0, "states": {
        "exp_avg": _state(bits=8, group_size=20000, rounding="stochastic"),
        "exp_avg_sq": _state(bits=5, map="power-1", signed=False, group_size=16383)}},
    "tensor_dim1": {"min_numel": 0, "states": {
        "exp_avg": _state(bits=4, scale="tensor"),
        "exp_avg_sq": _state(bits=6, map="power-2", signed=False, scale="dim1")}},
    "dim0_group7": {"min_numel": 0, "states": {
        "exp_avg": _state(bits=5, scale="dim0", rounding="stochastic"),
        "exp_avg_sq": _state(bits=7, map="power-1", signed=False, group_size=7)}},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "lion", "adamw_factored"])
@pytest.mark.parametrize("config", sorted(RARE_CONFIGS))
def test_cuda_matches_cpu_fused_on_large_and_odd_layouts(config, opt_name, dtype, allow_cuda_fusion, monkeypatch):
    monkeypatch.setitem(EXTRA_CONFIGS, config, RARE_CONFIGS[config])
    # (a zero-size parameter cannot have a factored second moment in either driver)
    shapes = [s for s in RARE_SHAPES if not (opt_name.endswith("factored") and 0 in s)]
    cuda_params, cuda_opt = run(opt_name, config, dtype, "cuda", True, steps=5, shapes=shapes)
    cpu_params, cpu_opt = run(opt_name, config, dtype, "cpu", True, steps=5, shapes=shapes)
    assert_identical(cuda_params, cuda_opt, cpu_params, cpu_opt)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "adamw_factored"])
@pytest.mark.parametrize("config", ["default.yml", "2nd_moment_group_128.yml", "8bit.yml", "tensor_dim0"])
def test_cuda_non_finite_gradients_match_cpu_fused(config, opt_name, allow_cuda_fusion):
    """NaN / Inf / overflowing gradient elements: the scales of the finite elements, saturated
    codes and finite factored statistics, bit-identical to the CPU (NaN parameters included)."""
    cuda_params, cuda_opt = run(opt_name, config, torch.float32, "cuda", True, steps=4, poison=True)
    cpu_params, cpu_opt = run(opt_name, config, torch.float32, "cpu", True, steps=4, poison=True)
    for i, (a, b) in enumerate(zip(cuda_params, cpu_params)):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=0, atol=0, equal_nan=True, msg=f"parameter {i}")
    sa, sb = _states(cuda_opt), _states(cpu_opt)
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, equal_nan=True, msg=str(k))
        if k[-1] == "scales":
            assert torch.isfinite(sa[k]).all(), k


WEIGHTS = {"sr": {"rounding": "stochastic"}, "kahan": {"compensation": "kahan"},
           "sr_kahan": {"rounding": "stochastic", "compensation": "kahan"}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("weights", sorted(WEIGHTS))
def test_cuda_low_precision_weights_match_cpu_fused(weights, opt_name, dtype, allow_cuda_fusion, monkeypatch):
    """Stochastic rounding and a Kahan buffer in the parameter's dtype: bit-identical to the CPU."""
    name = f"weights_{weights}"
    monkeypatch.setitem(EXTRA_CONFIGS, name, {"base": str(CONFIGS / "default.yml"), "min_numel": 100,
                                              "weights": WEIGHTS[weights]})
    cuda_params, cuda_opt = run(opt_name, name, dtype, "cuda", True, steps=5)
    cpu_params, cpu_opt = run(opt_name, name, dtype, "cpu", True, steps=5)
    assert_identical(cuda_params, cuda_opt, cpu_params, cpu_opt)


def test_cuda_quantized_kahan_buffer_is_refused_clearly(allow_cuda_fusion, monkeypatch):
    # the generic kernel's refusal (the specialized kernels take this buffer:
    # test_specialized_cuda.py), whatever QCONF_CUDA_KERNELS the suite runs under
    monkeypatch.setenv("QCONF_CUDA_KERNELS", "generic")
    p = torch.nn.Parameter(torch.randn(64, 64, device="cuda").to(torch.bfloat16))
    p.grad = torch.randn_like(p)
    opt = AdamW([p], compensation="kahan", qconfig={"weights": {"compensation_codec": {"bits": 8}}}, fused=True)
    with pytest.raises(RuntimeError, match="quantized Kahan buffer"):
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_functional_op_dispatches_to_cuda(dtype, allow_cuda_fusion, monkeypatch):
    """torch.ops.qconf.fused_step (the torch.compile path) reaches the CUDA kernel, with the
    codec tables on the CPU or on the GPU."""
    eager_params, eager_opt = run("adamw", "default.yml", dtype, "cuda", True, steps=3)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    op_params, op_opt = run("adamw", "default.yml", dtype, "cuda", True, steps=3)
    assert_identical(op_params, op_opt, eager_params, eager_opt)

    # one more step through the op with the tables already on the device
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    group = op_opt.param_groups[0]
    plan = op_opt._kernel._plans[id(group)][1]
    grads = [gr.to("cuda") for gr in _grads(3, dtype)]
    for p, gr in zip(eager_params, grads):
        p.grad = gr
    eager_opt.step()
    torch.ops.qconf.fused_step(plan.rule, plan.params, grads, plan.steps, plan.states, plan.meta,
                               plan.tables.to("cuda"), hyper_values(op_opt._hyper(group)), op_opt._seed)
    assert_identical(op_params, op_opt, eager_params, eager_opt)


def test_current_stream_is_used(allow_cuda_fusion):
    """The kernels run on the caller's current stream (results are ready after syncing it)."""
    ref_params, ref_opt = run("lion", "8bit.yml", torch.float32, "cuda", True, steps=2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        params, opt = run("lion", "8bit.yml", torch.float32, "cuda", True, steps=2)
    stream.synchronize()
    assert_identical(params, opt, ref_params, ref_opt)


def test_arguments_on_the_wrong_device_are_rejected(allow_cuda_fusion):
    params, opt = run("adamw", "default.yml", torch.float32, "cuda", True, steps=1)
    group = opt.param_groups[0]
    plan = opt._kernel._plans[id(group)][1]
    grads = [p.grad.cpu() for p in params]
    with pytest.raises(RuntimeError, match="not on the cuda"):
        torch.ops.qconf.fused_step(plan.rule, plan.params, grads, plan.steps, plan.states, plan.meta, plan.tables,
                                   hyper_values(opt._hyper(group)), opt._seed)
    cpu_states = [s.cpu() for s in plan.states]
    with pytest.raises(RuntimeError, match="state of parameter"):
        torch.ops.qconf.fused_step(plan.rule, plan.params, [p.grad for p in params], plan.steps, cpu_states,
                                   plan.meta, plan.tables, hyper_values(opt._hyper(group)), opt._seed)


def test_deepcopy_of_cuda_optimizer_steps_identically(allow_cuda_fusion):
    params, opt = run("sgd", "default.yml", torch.bfloat16, "cuda", True, steps=2)
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = SGD(params2, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, qconfig=CONFIGS / "default.yml",
               fused=True, seed=3)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step in range(2, 4):
        for p, p2, gr in zip(params, params2, _grads(step, torch.bfloat16)):
            p.grad = gr.to("cuda")
            p2.grad = gr.to("cuda")
        opt.step()
        opt2.step()
    assert_identical(params, opt, params2, opt2)
