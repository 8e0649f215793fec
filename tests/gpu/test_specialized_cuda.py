"""The specialized CUDA kernels (QCONF_CUDA_KERNELS=specialized) against the CPU fused step (needs
a CUDA GPU; tests/test_spec_host.py runs the same per-thread code on the host without one).

Every case of test_fused_cuda.py again with the specialized kernels -- the ahead-of-time specs and
the ones compiled with NVRTC at first use, the generic kernel for what they do not take -- bit
for bit against the CPU; then what only they do: the quantized Kahan buffer, the split step
(``GroupPlan.reduce`` / ``apply``, as FSDP2 shards use it) with unchanged and increased maxima,
a spec that fails to compile (warning, generic kernel), and refusals that leave everything as it was.
"""
from __future__ import annotations

import pytest
import torch

from qconf.optim import SGD, AdamW, Lion
from qconf.optim.fused import _signed64, hyper_values

from test_fused_cuda import (CASES, CONFIGS, EXTRA_CONFIGS, OPTIMIZERS, RARE_CONFIGS, RARE_SHAPES, _grads, _params,
                             _states, allow_cuda_fusion, assert_identical, run)  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def specialized(monkeypatch, tmp_path_factory):
    """The specialized kernels, with a fresh NVRTC cache for the session's run-time compilations."""
    monkeypatch.setenv("QCONF_CUDA_KERNELS", "specialized")
    monkeypatch.setenv("QCONF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qconf_cuda_cache"))


def _spec_names(opt):
    names = []
    for group in opt.param_groups:
        plan = opt._kernel._plans.get(id(group))
        if plan is not None:
            plan = plan[1]
            names += torch.ops.qconf.cuda_specs(plan.rule, plan.params, [p.grad for p in plan.params], plan.steps,
                                                plan.states, plan.meta, plan.tables,
                                                hyper_values(opt._hyper(group)), _signed64(opt._seed))
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("config", CASES)
def test_specialized_matches_cpu_fused(config, opt_name, dtype, allow_cuda_fusion):
    cuda_params, cuda_opt = run(opt_name, config, dtype, "cuda", True)
    cpu_params, cpu_opt = run(opt_name, config, dtype, "cpu", True)
    assert_identical(cuda_params, cuda_opt, cpu_params, cpu_opt)


def test_the_cases_reach_the_specialized_kernels(allow_cuda_fusion):
    _, opt = run("adamw", "default.yml", torch.float32, "cuda", True, steps=2)
    names = _spec_names(opt)
    assert sum(not n.startswith("generic") for n in names) >= 3, names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "lion", "adamw_factored"])
@pytest.mark.parametrize("config", sorted(RARE_CONFIGS))
def test_specialized_matches_cpu_fused_on_large_and_odd_layouts(config, opt_name, dtype, allow_cuda_fusion,
                                                                monkeypatch):
    monkeypatch.setitem(EXTRA_CONFIGS, config, RARE_CONFIGS[config])
    shapes = [s for s in RARE_SHAPES if not (opt_name.endswith("factored") and 0 in s)]
    cuda_params, cuda_opt = run(opt_name, config, dtype, "cuda", True, steps=5, shapes=shapes)
    cpu_params, cpu_opt = run(opt_name, config, dtype, "cpu", True, steps=5, shapes=shapes)
    assert_identical(cuda_params, cuda_opt, cpu_params, cpu_opt)


@pytest.mark.parametrize("config", ["default.yml", "2nd_moment_group_128.yml", "8bit.yml", "default_5b.yml"])
def test_specialized_non_finite_gradients_match_cpu_fused(config, allow_cuda_fusion):
    cuda_params, cuda_opt = run("adamw", config, torch.float32, "cuda", True, steps=4, poison=True)
    cpu_params, cpu_opt = run("adamw", config, torch.float32, "cpu", True, steps=4, poison=True)
    for i, (a, b) in enumerate(zip(cuda_params, cpu_params)):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=0, atol=0, equal_nan=True, msg=f"parameter {i}")
    sa, sb = _states(cuda_opt), _states(cpu_opt)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, equal_nan=True, msg=str(k))


#: the parameters of the low-precision weights cases (every one a specialized kernel takes)
WEIGHTS_SHAPES = [(96, 128), (96,), (4099,), (64, 256)]
WEIGHTS = {"sr": {"rounding": "stochastic"}, "kahan": {"compensation": "kahan"},
           "sr_kahan": {"rounding": "stochastic", "compensation": "kahan"},
           "kahan_q8": {"compensation": "kahan", "compensation_codec": {"bits": 8, "group_size": 128}},
           "sr_kahan_q4": {"rounding": "stochastic", "compensation": "kahan",
                           "compensation_codec": {"bits": 4, "group_size": 64, "rounding": "stochastic"}}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("weights", sorted(WEIGHTS))
def test_specialized_low_precision_weights_match_cpu_fused(weights, opt_name, dtype, allow_cuda_fusion,
                                                           monkeypatch):
    """Stochastic rounding, Kahan buffers in the parameter's dtype and quantized (which the
    generic CUDA kernel refuses): bit-identical to the CPU. Only shapes the specialized kernels
    take, for every rule (the generic kernel has no quantized buffer): no 3-D 5x5 kernels or 7x3
    tensors, and no rows of 64 -- beside AdamW's rank-1 second moment, exp_avg's blocks of 128
    would span two rows (tests/test_spec_host.py checks these shapes' specs on the host)."""
    name = f"weights_{weights}"
    monkeypatch.setitem(EXTRA_CONFIGS, name, {"base": str(CONFIGS / "default.yml"), "min_numel": 100,
                                              "weights": WEIGHTS[weights]})
    shapes = WEIGHTS_SHAPES
    cuda_params, cuda_opt = run(opt_name, name, dtype, "cuda", True, steps=5, shapes=shapes)
    cpu_params, cpu_opt = run(opt_name, name, dtype, "cpu", True, steps=5, shapes=shapes)
    assert_identical(cuda_params, cuda_opt, cpu_params, cpu_opt)


def test_quantized_kahan_without_a_specialized_kernel_is_refused_before_anything_changes(allow_cuda_fusion):
    # a compensation codec with 100-element groups: no spec takes it, and the generic kernel has no
    # quantized buffer
    p = torch.nn.Parameter(torch.randn(64, 100, device="cuda").to(torch.bfloat16))
    opt = AdamW([p], compensation="kahan", fused=True,
                qconfig={"min_numel": 0, "weights": {"compensation_codec": {"bits": 8, "group_size": 100}}})
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="quantized Kahan buffer.*has none"):
        opt.step()
    assert torch.equal(p.detach(), before)
    assert float(opt.state[p]["step"]) == 0.0


def test_wrong_device_arguments_change_nothing(allow_cuda_fusion):
    params, opt = run("adamw", "default.yml", torch.float32, "cuda", True, steps=1)
    group = opt.param_groups[0]
    plan = opt._kernel._plans[id(group)][1]
    before = [t.clone() for t in [*plan.params, *plan.steps, *plan.states]]
    with pytest.raises(RuntimeError, match="not on the cuda"):
        torch.ops.qconf.fused_step(plan.rule, plan.params, [p.grad.cpu() for p in params], plan.steps, plan.states,
                                   plan.meta, plan.tables, hyper_values(opt._hyper(group)), opt._seed)
    assert all(torch.equal(a, b) for a, b in zip(before, [*plan.params, *plan.steps, *plan.states]))


def test_a_spec_that_does_not_compile_takes_the_generic_kernel(allow_cuda_fusion, monkeypatch, tmp_path):
    # default_6b.yml's specs are not compiled ahead of time; without NVRTC they cannot be built
    monkeypatch.setenv("QCONF_NVRTC_LIBRARY", str(tmp_path / "no-libnvrtc.so"))
    monkeypatch.setenv("QCONF_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="did not compile"):
        cuda_params, cuda_opt = run("adamw", "default_6b.yml", torch.float32, "cuda", True, steps=3)
    cpu_params, cpu_opt = run("adamw", "default_6b.yml", torch.float32, "cpu", True, steps=3)
    assert_identical(cuda_params, cuda_opt, cpu_params, cpu_opt)


# ---------------------------------------------------------------------------------------------
# the split step (GroupPlan.reduce / apply) on one GPU, as tests/test_fused_split.py on the CPU

SPLIT_SHAPES = [(96, 256), (8, 4864), (4099,), (33, 128), (7,)]
RULES = {
    "adamw": lambda ps, cfg: AdamW(ps, lr=1e-2, weight_decay=0.01, qconfig=cfg, fused=True, seed=3),
    "sgd": lambda ps, cfg: SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, qconfig=cfg, fused=True, seed=3),
    "lion": lambda ps, cfg: Lion(ps, lr=1e-3, weight_decay=0.1, qconfig=cfg, fused=True, seed=3),
}
SPLIT_CONFIGS = {
    "rank1": {"min_numel": 100, "states": {
        "exp_avg": {"bits": 4, "map": "nonlinear", "signed": True, "scale": "rank1", "rounding": "stochastic"},
        "exp_avg_sq": {"bits": 4, "map": "power-1", "signed": False, "scale": "rank1"}}},
    "default": str(CONFIGS / "default.yml"),
    "group": str(CONFIGS / "2nd_moment_group_128.yml"),
    "bf16_sr_kahan_q8": {"base": str(CONFIGS / "default.yml"), "min_numel": 100,
                         "weights": {"rounding": "stochastic", "compensation": "kahan",
                                     "compensation_codec": {"bits": 8, "group_size": 128}}},
}


def _split_run(rule, config, device, steps, split, change=None):
    dtype = torch.bfloat16 if config.startswith("bf16") else torch.float32
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype).to(device)) for s in SPLIT_SHAPES]
    opt = RULES[rule](params, SPLIT_CONFIGS[config])
    seen = []
    for step in range(steps):
        gg = torch.Generator().manual_seed(1000 + step)
        grads = [(torch.randn(s, generator=gg) * 10.0 ** (step % 3 - 3)).to(dtype).to(device) for s in SPLIT_SHAPES]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        if not split:
            opt.step()
            continue
        group = opt.param_groups[0]
        plan = opt._kernel._eager_plan(id(group), *opt._plan_source(group))
        maxima, offsets = plan.reduce(opt._kernel.hyper_values(opt._hyper(group)), opt._seed, grads)
        if change is not None and step == steps - 1:
            change(maxima)
        seen.append((maxima.clone().cpu(), offsets.clone()))
        plan.apply(maxima)
    return params, opt, seen


def _increase(maxima):
    maxima[::2] = maxima[::2] * 1.75 + 1e-3
    maxima[maxima == 0] = 1e-40


@pytest.mark.parametrize("config", sorted(SPLIT_CONFIGS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_split_step_on_cuda_equals_run_and_the_cpu_split(rule, config, allow_cuda_fusion):
    run_params, run_opt, _ = _split_run(rule, config, "cuda", 3, split=False)
    cuda_params, cuda_opt, cuda_seen = _split_run(rule, config, "cuda", 3, split=True)
    cpu_params, cpu_opt, cpu_seen = _split_run(rule, config, "cpu", 3, split=True)
    assert_identical(cuda_params, cuda_opt, run_params, run_opt)
    assert_identical(cuda_params, cuda_opt, cpu_params, cpu_opt)
    for (mc, oc), (mh, oh) in zip(cuda_seen, cpu_seen):
        # the two-pass (rank-1) states' maxima in the CPU's layout, equal (groups of 128 are
        # single-pass in both)
        assert torch.equal(oc, oh)
        assert torch.equal(mc, mh)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_split_step_on_cuda_takes_increased_maxima_like_the_cpu(rule, allow_cuda_fusion):
    cuda_params, cuda_opt, _ = _split_run(rule, "rank1", "cuda", 3, split=True, change=_increase)
    cpu_params, cpu_opt, _ = _split_run(rule, "rank1", "cpu", 3, split=True, change=_increase)
    assert_identical(cuda_params, cuda_opt, cpu_params, cpu_opt)
