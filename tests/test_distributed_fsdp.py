"""FSDP2 (``fully_shard``, DTensor parameters) on 2 gloo ranks: the quantization of every state is
the unsharded run's (plans, codes, scales, params bit for bit when fed the same gradients), DCP
checkpoints reshard 2 -> 1 -> 2 ranks, ``get/set_optimizer_state_dict`` round-trip exactly, a
bad distributed checkpoint is refused on every rank with the optimizer left as it was, and Muon
refuses sharded matrices by name while its AdamW part trains them as qconf AdamW does.
(docs/distributed.md states the semantics these tests check.)"""
from __future__ import annotations

import pytest
import torch

import fsdp_workers as W
import qconf.optim as qo
from qconf._native import fused_available as native_fused
from dist_harness import spawn

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")

#: end-to-end training (each rank backpropagates half the batch; FSDP2 averages the gradients in a
#: different order than one process does): after 20 steps, per parameter, mean |a - b| / mean |b|
#: and max |a - b| / max |b| against the single-process run, and the losses' relative difference
#: (docs/distributed.md). torch.optim.AdamW in the same experiment: 4.5e-4, 1.8e-3, 1.1e-7; qconf
#: 4-bit: 4.7e-4, 1.4e-2 (an element whose state sits at a rounding threshold takes the other
#: code), 1.0e-5.
TRAINED_MEAN_RTOL, TRAINED_MAX_RTOL, TRAINED_LOSS_RTOL = 1e-3, 5e-2, 1e-4


def _invariance_rank(rank: int, world: int, qconfig: dict, fused: bool | None, dtype: torch.dtype) -> dict:
    model = W.shard(W.make_model(dtype), world)
    opt = W.make_optimizer(model, qconfig, fused)
    W.step_with_grads(opt, model, 20)
    from qconf import memory_report

    report = memory_report(opt)
    return {"plans": W.plans(opt), "states": W.full_states(opt, model),
            "params": {n: p.full_tensor() for n, p in model.named_parameters()},
            "memory": (report.numel, report.total_bytes, report.fp32_bytes, report.whole_model)}


BF16 = torch.bfloat16


@pytest.mark.parametrize("qconfig, fused, dtype", [
    (W.QCONFIG, None, torch.float32), (W.QCONFIG_SR, None, torch.float32), (W.QCONFIG_ALIGNED, True, torch.float32),
    (W.QCONFIG_TENSOR, None, torch.float32), (W.QCONFIG_SR_WEIGHTS, True, BF16), (W.QCONFIG_KAHAN, None, BF16)],
    ids=["rank1-nearest-mixed", "dim1-stochastic-mixed", "rank1-stochastic-fused", "tensor-mixed",
         "bf16-sr-weights-fused", "bf16-kahan-mixed"])
def test_sharded_states_equal_the_unsharded_run_bit_for_bit(qconfig, fused, dtype):
    """Mixed: the fused kernel steps the shards whose group blocks align with the shard
    boundaries, the reference path the others (fused=None falls back per parameter); fused=True:
    every shard is fused (the blocks align), so the split kernel's maxima feed the all-reduce."""
    if fused and not native_fused():
        pytest.skip("qconf._C is not built")
    ranks = spawn(_invariance_rank, 2, qconfig, fused, dtype)
    model = W.make_model(dtype)
    opt = W.make_optimizer(model, qconfig, fused)
    W.step_with_grads(opt, model, 20)
    want = W.unsharded_states(opt, model)
    kinds = {v[0] for entry in want.values() for key, v in entry.items() if key != "step"}
    assert kinds == {"q", "t"}  # both quantized and dense states are covered
    from qconf import memory_report

    single = memory_report(opt)
    per_rank = [got["memory"] for got in ranks]
    assert all(m[3] == per_rank[0][3] for m in per_rank)  # the same whole-model figures on every rank
    assert [sum(m[i] for m in per_rank) for i in range(3)] == list(per_rank[0][3])
    numel, total, fp32 = per_rank[0][3]
    assert (numel, fp32) == (single.numel, single.fp32_bytes)
    # each rank also holds the scales its shard shares with a neighbour (and a few padding codes)
    assert single.total_bytes <= total <= single.total_bytes * 1.02
    for got in ranks:
        assert got["plans"] == W.plans(opt)  # quantize or not, and the codec, of every state
        for name, p in model.named_parameters():
            assert torch.equal(got["params"][name], p.detach()), name
            assert got["states"][name].keys() == want[name].keys(), name
            for key, value in want[name].items():
                mine = got["states"][name][key]
                assert mine[0] == value[0], (name, key)
                assert all(_same(a, b) for a, b in zip(mine[1:], value[1:])), (name, key)


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _trained_rank(rank: int, world: int) -> dict:
    model = W.shard(W.make_model(), world)
    opt = W.make_optimizer(model, W.QCONFIG)
    losses = W.train(opt, model, 20, 0, rank, world)
    return {"losses": losses, "params": {n: p.full_tensor() for n, p in model.named_parameters()}}


def test_trained_through_backward_stays_close_to_one_process():
    ranks = spawn(_trained_rank, 2)
    model = W.make_model()
    opt = W.make_optimizer(model, W.QCONFIG)
    losses = W.train(opt, model, 20, 0, 0, 1)
    assert ranks[0]["losses"] == pytest.approx(losses, rel=TRAINED_LOSS_RTOL)
    for name, p in model.named_parameters():
        got, want = ranks[0]["params"][name].detach(), p.detach()
        assert float((got - want).abs().mean() / want.abs().mean()) <= TRAINED_MEAN_RTOL, name
        assert float((got - want).abs().max() / want.abs().max()) <= TRAINED_MAX_RTOL, name


def _save_rank(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_optimizer_state_dict

    model = W.shard(W.make_model(), world)
    opt = W.make_optimizer(model, W.QCONFIG)
    W.train(opt, model, 5, 0, rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    first = get_optimizer_state_dict(model, opt)
    set_optimizer_state_dict(model, opt, first)
    again = get_optimizer_state_dict(model, opt)
    return {"roundtrip": _flat(first) == _flat(again) and _equal_tensors(first, again),
            "losses": W.train(opt, model, 5, 5, rank, world)}


def _flat(sd, prefix=""):
    """The structure of a nested state dict: keys and leaf types."""
    if isinstance(sd, dict):
        return {k: _flat(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_flat(v) for v in sd]
    return type(sd).__name__ if isinstance(sd, torch.Tensor) else sd


def _equal_tensors(a, b) -> bool:
    if isinstance(a, dict):
        return all(_equal_tensors(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return all(_equal_tensors(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(a, DTensor):
            return a.placements == b.placements and torch.equal(a.to_local(), b.to_local())
        return torch.equal(a, b)
    return True


def _load_rank(rank: int, world: int, path: str) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = W.shard(W.make_model(), world)
    opt = W.make_optimizer(model, W.QCONFIG)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return W.train(opt, model, 5, 5, rank, world)


def test_dcp_saved_on_2_ranks_resumes_on_1_and_on_2(tmp_path):
    saved = spawn(_save_rank, 2, str(tmp_path))
    assert saved[0]["roundtrip"] and saved[1]["roundtrip"]  # get/set_optimizer_state_dict round-trip exactly
    want = saved[0]["losses"]
    for world in (1, 2):
        got = spawn(_load_rank, world, str(tmp_path))[0]
        assert got == pytest.approx(want, rel=1e-5), world


def _bad_checkpoint_rank(rank: int, world: int) -> list[str]:
    import copy

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = W.shard(W.make_model(), world)
    opt = W.make_optimizer(model, W.QCONFIG)
    W.step_with_grads(opt, model, 2)
    before = W.full_states(opt, model)
    errors = []
    good = get_optimizer_state_dict(model, opt)
    bad_scales = copy.deepcopy(good)  # corrupt on rank 1 only: rank 0 must refuse too, not hang
    if rank == 1:
        bad_scales["state"]["block.qkv.weight"]["exp_avg"]["scales"][0] = float("nan")
    bad_shape = copy.deepcopy(good)
    bad_shape["state"]["head.weight"]["exp_avg"]["shape"] = [60, 48]
    for bad in (bad_scales, bad_shape):
        try:
            set_optimizer_state_dict(model, opt, bad)
        except ValueError as e:
            errors.append(str(e))
    after = W.full_states(opt, model)
    unchanged = all(_same_state(before[n][k], after[n][k]) for n in before for k in before[n])
    try:  # fused=True promises the native kernel or an error: QCONFIG's group blocks straddle shards
        W.step_with_grads(W.make_optimizer(model, W.QCONFIG, fused=True), model, 1)
    except RuntimeError as e:
        errors.append(str(e))
    return errors + [f"unchanged={unchanged}"]


def _same_state(a, b) -> bool:
    return a[0] == b[0] and all(_same(x, y) for x, y in zip(a[1:], b[1:]))


def test_a_bad_distributed_checkpoint_is_refused_on_every_rank_and_changes_nothing():
    for rank, report in enumerate(spawn(_bad_checkpoint_rank, 2)):
        assert report[-1] == "unchanged=True", rank
        assert len(report) == 4, report
        assert "scales" in report[0] or "another rank" in report[0], report[0]
        assert "shape" in report[1], report[1]
        assert "fused=True" in report[2] and "block.mlp.0.weight" in report[2], report[2]
        assert "shard boundary inside a 64-element block" in report[2], report[2]


def _muon_rank(rank: int, world: int) -> dict:
    """Muon on the sharded model: the errors of routing its sharded matrices to Muon (by default
    routing, and in a use_muon=True group of named or of plain tensors), the routing with every
    parameter sent to AdamW (route, and a use_muon=False group), and, trained 5 steps through
    backward, that hybrid's losses, parameters and states next to qconf AdamW's on a second copy."""
    errors = {}
    model = W.shard(W.make_model(), world)
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("block.")]
    for how, params in (("routed", model.named_parameters()),
                        ("named group", [{"params": matrices, "use_muon": True}]),
                        ("plain group", [{"params": [p for _, p in matrices], "use_muon": True}])):
        try:
            qo.Muon(params, qconfig=W.QCONFIG)
            errors[how] = None
        except ValueError as e:
            errors[how] = str(e)
    group = qo.Muon([{"params": list(model.named_parameters()), "use_muon": False}], qconfig=W.QCONFIG)
    hybrid = qo.Muon(model.named_parameters(), route={"*": "adamw"}, adamw={"lr": 3e-3, "weight_decay": 0.01},
                     qconfig=W.QCONFIG_SR, seed=7)
    routing = {"route": hybrid.routing(), "group": group.routing()}
    losses = W.train(hybrid, model, 5, 0, rank, world)
    other = W.shard(W.make_model(), world)
    adamw = qo.AdamW(other.named_parameters(), lr=3e-3, weight_decay=0.01, qconfig=W.QCONFIG_SR, seed=7)
    return {"errors": errors, "routing": routing, "losses": (losses, W.train(adamw, other, 5, 0, rank, world)),
            "params": [{n: p.full_tensor() for n, p in m.named_parameters()} for m in (model, other)],
            "states": (W.full_states(hybrid, model), W.full_states(adamw, other))}


def test_muon_refuses_sharded_matrices_and_its_adamw_part_trains_them_as_adamw():
    """Newton–Schulz needs the whole matrix and qconf does not gather it: a sharded 2-D weight that
    the routing (or a use_muon=True group) gives Muon is a ValueError at construction, on every
    rank, naming the parameter and the way out. Routed to AdamW (route={"*": "adamw"} or a
    use_muon=False group), the sharded model trains through backward exactly as under qconf AdamW
    with the same hyperparameters: losses, parameters and every state (codes, scales, codec) bit
    for bit, with stochastic rounding."""
    for rank, got in enumerate(spawn(_muon_rank, 2)):
        errors = got["errors"]
        for how in ("routed", "named group"):  # the first matrix Muon takes (emb.weight goes to AdamW by name)
            assert errors[how] is not None and "'block.qkv.weight'" in errors[how], (rank, how, errors[how])
        for how, e in errors.items():
            assert e is not None and "sharded (an FSDP2 DTensor)" in e and "Newton–Schulz needs the whole matrix" in e \
                and "route it to 'adamw'" in e, (rank, how, e)
        names = [n for n, _ in W.make_model().named_parameters()]
        assert got["routing"]["route"] == got["routing"]["group"] == dict.fromkeys(names, "adamw"), rank
        ours, theirs = got["losses"]
        assert ours == theirs and ours[-1] < ours[0], (rank, ours, theirs)
        for name in names:
            assert torch.equal(got["params"][0][name], got["params"][1][name]), (rank, name)
        ours, theirs = got["states"]
        assert ours.keys() == theirs.keys(), rank
        for name, want in theirs.items():
            assert ours[name].keys() == want.keys(), (rank, name)
            for key, value in want.items():
                assert ours[name][key][0] == value[0], (rank, name, key)
                assert all(_same(a, b) for a, b in zip(ours[name][key][1:], value[1:])), (rank, name, key)
        assert any(v[0] == "q" for entry in theirs.values() for v in entry.values()), "no quantized state"
