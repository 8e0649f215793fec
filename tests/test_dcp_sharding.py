"""Checkpoints move between FSDP2 runs and plain (unsharded) ones through
``torch.distributed.checkpoint``: quantized states have one state-dict layout whatever the
sharding (codes packed row by row, :mod:`qconf.optim.records`), so a checkpoint saved on 2 ranks
loads into a plain model in one process, a plain one into 2 ranks, and a full state dict
(``full_state_dict=True``) into a plain optimizer -- with the states bit for bit and the resumed
run within docs/distributed.md's tolerance of the run that saved it. (2 -> 1 rank FSDP2:
tests/test_distributed_fsdp.py.)"""
from __future__ import annotations

import copy

import pytest
import torch

import fsdp_workers as W
from dist_harness import spawn

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")

#: the resumed losses against the saving run's own continuation: one process against two ranks
#: averages the gradients in another order (tests/test_distributed_fsdp.py TRAINED_LOSS_RTOL)
RESUMED_LOSS_RTOL = 1e-4
STEPS = 5


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _save_sharded(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    model = W.shard(W.make_model(), world)
    opt = W.make_optimizer(model, W.QCONFIG)
    W.train(opt, model, STEPS, 0, rank, world)
    dcp.save(_dcp_state(model, opt), checkpoint_id=f"{path}/dcp")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    whole = {"model": get_model_state_dict(model, options=full), "optim": get_optimizer_state_dict(model, opt, options=full)}
    if rank == 0:
        torch.save(whole, f"{path}/full.pt")
    states = copy.deepcopy(W.full_states(opt, model))  # (may share live tensors: training changes them)
    return {"states": states, "losses": W.train(opt, model, STEPS, STEPS, rank, world)}


def _load_plain(rank: int, world: int, path: str, how: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, set_state_dict

    model = W.make_model()
    opt = W.make_optimizer(model, W.QCONFIG)
    if how == "dcp":
        sd = _dcp_state(model, opt)
        dcp.load(sd, checkpoint_id=f"{path}/dcp")
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:  # the full state dict of the sharded run, as torch.save wrote it
        whole = torch.load(f"{path}/full.pt", weights_only=True)
        model.load_state_dict(whole["model"])
        set_optimizer_state_dict(model, opt, whole["optim"])
    states = copy.deepcopy(W.unsharded_states(opt, model))  # (live tensors: training changes them)
    return {"states": states, "losses": W.train(opt, model, STEPS, STEPS, 0, 1)}


def _save_plain(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model = W.make_model()
    opt = W.make_optimizer(model, W.QCONFIG)
    W.train(opt, model, STEPS, 0, 0, 1)
    dcp.save(_dcp_state(model, opt), checkpoint_id=f"{path}/dcp")
    states = copy.deepcopy(W.unsharded_states(opt, model))  # (live tensors: training changes them)
    return {"states": states, "losses": W.train(opt, model, STEPS, STEPS, 0, 1)}


def _load_sharded(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model = W.shard(W.make_model(), world)
    opt = W.make_optimizer(model, W.QCONFIG)
    sd = _dcp_state(model, opt)
    dcp.load(sd, checkpoint_id=f"{path}/dcp")
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    states = copy.deepcopy(W.full_states(opt, model))
    return {"states": states, "losses": W.train(opt, model, STEPS, STEPS, rank, world)}


def _assert_same_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            x, y = a[name][key], b[name][key]
            assert x[0] == y[0], (name, key)
            if x[0] == "q":
                assert torch.equal(x[1], y[1]) and torch.equal(x[2], y[2]) and x[3] == y[3], (name, key)
            else:
                assert torch.equal(x[1], y[1]), (name, key)


@pytest.mark.parametrize("how", ["dcp", "full_state_dict"])
def test_fsdp2_checkpoint_loads_into_a_plain_model(tmp_path, how):
    saved = spawn(_save_sharded, 2, str(tmp_path))[0]
    loaded = spawn(_load_plain, 1, str(tmp_path), how)[0]
    _assert_same_states(saved["states"], loaded["states"])
    assert loaded["losses"] == pytest.approx(saved["losses"], rel=RESUMED_LOSS_RTOL)


def test_plain_checkpoint_loads_into_fsdp2_on_2_ranks(tmp_path):
    saved = spawn(_save_plain, 1, str(tmp_path))[0]
    ranks = spawn(_load_sharded, 2, str(tmp_path))
    for loaded in ranks:
        _assert_same_states(saved["states"], loaded["states"])
        assert loaded["losses"] == pytest.approx(saved["losses"], rel=RESUMED_LOSS_RTOL)
