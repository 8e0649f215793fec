"""Gradient release in multi-process training (2 gloo ranks, tests/dist_harness.py): refused, never a
step on an unreduced gradient. DDP reduces a gradient after it is accumulated, so a release step
would see the local one; FSDP2's parameters are sharded DTensors. Refused at
prepare_gradient_release, and -- for hooks registered before the process group existed -- in the
hook, before anything is stepped. One spawn runs every case."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

from dist_harness import spawn  # noqa: E402
from helpers import mlp, regression_batches  # noqa: E402


def _refusal(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return "not refused"


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from qconf.optim import AdamW, prepare_gradient_release, release

    out = {}
    x, y = next(regression_batches(1, seed=rank))
    # DDP: refused when preparing
    model = mlp(0)
    opt = AdamW(model.named_parameters(), gradient_release=True)
    out["ddp_prepare"] = _refusal(lambda: prepare_gradient_release(DistributedDataParallel(model), opt))
    # hooks registered as if before init_process_group, then DDP: refused in the first hook
    model = mlp(0)
    before = [p.detach().clone() for p in model.parameters()]
    opt = AdamW(model.named_parameters(), gradient_release=True)
    with mock.patch.object(release, "_multi_process_reason", return_value=None):
        prepare_gradient_release(model, opt)
    ddp = DistributedDataParallel(model)
    out["ddp_hook"] = _refusal(lambda: torch.nn.functional.mse_loss(ddp(x), y).backward())
    out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    out["no_state"] = all("step" not in opt.state[p] for p in model.parameters())
    # FSDP2: sharded DTensor parameters
    model = mlp(0)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = AdamW(model.named_parameters(), gradient_release=True)
    out["fsdp_prepare"] = _refusal(lambda: prepare_gradient_release(model, opt))
    return out


def test_ddp_and_fsdp2_are_refused_before_any_step():
    for out in spawn(_worker, 2):
        assert "gradient release is not supported here: torch.distributed runs 2 processes" in out["ddp_prepare"]
        assert "unreduced gradient" in out["ddp_prepare"]
        assert "torch.distributed runs 2 processes" in out["ddp_hook"]
        assert out["unchanged"] and out["no_state"]
        assert "its parameters are sharded DTensors (FSDP2)" in out["fsdp_prepare"]
