"""The native step against the reference path over a seeded shape fuzz (tests/native_fuzz.py):
numel 1 to 300,000 (primes, powers of two and their neighbours), group sizes 1 to the validator's
maximum, every scale kind and map, bits 1-8, AdamW/Adam/SGD/Lion/factored/Muon (2-D: tall, wide,
odd, single rows and columns), fp32/bf16/fp16 parameters with every weights mode, strided and not,
1-4 threads, every ISA of this machine.

Every case runs in a child process, so a case that crashes the process (a buffer overrun, an
abort) fails its batch here, naming the case, and the other cases still run. Deterministic: the
cases come from fixed seeds. QCONF_FUZZ_CASES=N runs N random cases per batch instead of 40
(tests/sanitize.py runs fewer under AddressSanitizer).
"""
from __future__ import annotations

import os

import pytest

from qconf import _native
from qconf.config.rules import MAX_GROUP_SIZE

import native_fuzz
from helpers import machine_isas

if not _native.fused_available():  # pragma: no cover - the CI build always has the extension
    pytest.skip(f"fused kernels unavailable: {_native.native_error()}", allow_module_level=True)

BATCHES = 6
CASES_PER_BATCH = int(os.environ.get("QCONF_FUZZ_CASES", "40"))


def test_fuzz_covers_the_validators_group_range():
    assert native_fuzz.MAX_GROUP == MAX_GROUP_SIZE
    assert native_fuzz.GROUPS[0] == 1 and native_fuzz.GROUPS[-1] == MAX_GROUP_SIZE
    cases = [c for b in range(BATCHES) for c in native_fuzz.cases(b, CASES_PER_BATCH, machine_isas())]
    assert {c["rule"] for c in cases} == set(native_fuzz.RULES)
    assert {c["isa"] for c in cases} == set(machine_isas())
    assert {c["dtype"] for c in cases} == set(native_fuzz.DTYPES)
    muon = [c for c in cases if c["rule"] == "muon"]
    assert all(len(c["shape"]) == 2 for c in muon)
    assert {c["dtype"] for c in muon} == set(native_fuzz.DTYPES)
    shapes = [c["shape"] for c in muon]
    assert any(r > c > 1 for r, c in shapes) and any(1 < r < c for r, c in shapes)  # tall and wide
    assert {c["weights"]["compensation"] for c in muon if c["weights"]} == {"none", "kahan"}
    assert {c["muon"]["nesterov"] for c in muon} == {True, False}


def test_muon_cases_on_every_isa(tmp_path):
    """Muon's two kernel calls (the momentum into a bf16 scratch, the update with the weights
    policy) on fixed matrices -- multi-tile, tall, wide, one row, strided; group, rank-1, dim1 and
    tensor momentum scales; bf16 stochastic + quantized Kahan, fp16 Kahan -- on every ISA, equal to
    the reference bit for bit (tests/sanitize.py runs them under the sanitizers)."""
    problems = native_fuzz.run_isolated(native_fuzz.muon_cases(machine_isas()), tmp_path)
    assert not problems, "\n".join(problems)


def test_groups_larger_than_the_tensor_on_every_isa(tmp_path):
    """The edge cases first: a group of 2^20 .. 2^24 on tensors of 2048 .. 100,000 elements is one
    group (one scale for the whole tensor), equal to the reference; it overran a tile buffer."""
    problems = native_fuzz.run_isolated(native_fuzz.edge_cases(machine_isas()), tmp_path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("batch", range(BATCHES))
def test_random_cases_equal_the_reference(batch, tmp_path):
    problems = native_fuzz.run_isolated(native_fuzz.cases(batch, CASES_PER_BATCH, machine_isas()), tmp_path)
    assert not problems, f"{len(problems)} of {CASES_PER_BATCH} cases:\n" + "\n".join(problems)


@pytest.mark.parametrize("fused", [False, True])
def test_a_group_longer_than_the_tensor_is_one_group(fused):
    """The chosen behaviour for a legal but pointless size: a group longer than the tensor (up to
    the validator's 2^24) is one group, so it stores one scale and the same codes as ``scale:
    tensor``, on both paths (not refused: one config serves tensors of every size)."""
    import torch

    from qconf.optim import AdamW

    def states(scale):
        p = torch.nn.Parameter(torch.randn(5000, generator=torch.Generator().manual_seed(0)))
        codec = {"bits": 4, "scale": scale, "group_size": MAX_GROUP_SIZE}
        opt = AdamW([p], lr=1e-2, fused=fused, qconfig={"min_numel": 0, "states": {
            "exp_avg": codec, "exp_avg_sq": {**codec, "map": "power-1", "signed": False}}})
        for step in range(3):
            p.grad = torch.randn(5000, generator=torch.Generator().manual_seed(step + 1))
            opt.step()
        return p, opt.state[p]

    p_group, group = states("group")
    p_tensor, tensor = states("tensor")
    assert torch.equal(p_group, p_tensor)
    for key in ("exp_avg", "exp_avg_sq"):
        assert group[key].scales.numel() == 1
        assert torch.equal(group[key].codes, tensor[key].codes) and torch.equal(group[key].scales, tensor[key].scales)


def test_the_reported_crash_runs_and_equals_the_reference(tmp_path):
    """The report's example (a 5000-element parameter, exp_avg groups of 2^20 or 2^24, the rest of
    the default qconfig) with AdamW, SGD and Lion on every ISA, in a child process: it aborted
    with "double free or corruption" or a segmentation fault."""
    cases = []
    for rule in ("adamw", "sgd", "lion"):
        for group_size in (1 << 20, MAX_GROUP_SIZE):
            state = {"enable": True, "bits": 4, "map": "nonlinear", "signed": True, "scale": "group",
                     "group_size": group_size, "rounding": "nearest"}
            cases += [{"rule": rule, "shape": [5000], "dtype": "float32", "states": {"exp_avg": state},
                       "weights": None, "strided": False, "threads": 2, "isa": isa} for isa in machine_isas()]
    problems = native_fuzz.run_isolated(cases, tmp_path)
    assert not problems, "\n".join(problems)
