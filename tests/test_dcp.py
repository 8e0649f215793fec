"""torch.distributed.checkpoint (DCP): qconf's own section (seed, overrides, qconfig) survives
``get_optimizer_state_dict`` -> ``dcp.save`` -> ``dcp.load`` -> ``set_optimizer_state_dict``, so a
stochastic-rounding run resumed through DCP is bit-identical to one that never stopped -- AdamW,
and the Muon hybrid (Muon's quantized momentum and its AdamW part's states, one optimizer).

Single process: DCP runs without a process group (``no_dist``); the state-dict helpers need none.
"""
from __future__ import annotations

import pytest
import torch

from qconf.codec import QTensor
from qconf.optim import AdamW, Muon, export_torch_state_dict

from helpers import CONFIGS, assert_same_state, flat_state, mlp, regression_batches

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict  # noqa: E402

# stochastic rounding of both states: the random numbers depend on the optimizer's seed
SR_CFG = {"min_numel": 64,
          "states": {"exp_avg": {"rounding": "stochastic"},
                     "exp_avg_sq": {"rounding": "stochastic", "map": "power-1", "signed": False}}}
STEPS, SPLIT = 8, 4
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _make(seed, fused=False):
    model = mlp(3)
    opt = AdamW(model.named_parameters(), lr=3e-3, qconfig=SR_CFG, fused=fused, seed=seed)
    opt.override_quantize_enable(model[2], "bias", True)  # an override the fresh optimizer has not made
    return model, opt


@pytest.mark.parametrize("fused", [False, None])
def test_dcp_resume_with_stochastic_rounding_is_bit_identical(tmp_path, fused):
    batches = list(regression_batches(STEPS, seed=7))
    ref_model, ref = _make(seed=1, fused=fused)
    for x, y in batches:
        _step(ref_model, ref, x, y)

    model, opt = _make(seed=1, fused=fused)
    for x, y in batches[:SPLIT]:
        _step(model, opt, x, y)
    osd = get_optimizer_state_dict(model, opt)
    assert all(g["qconf"]["seed"] == 1 for g in osd["param_groups"])  # DCP keeps the section
    dcp.save({"model": model.state_dict(), "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))

    model2 = mlp(99)
    opt2 = AdamW(model2.named_parameters(), lr=3e-3, qconfig=SR_CFG, fused=fused, seed=12345)
    # a fresh optimizer has no state: DCP initialises it with a zero-grad, lr=0 step
    template = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    assert all(g["qconf"]["seed"] == 12345 for g in template["optim"]["param_groups"])
    dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"))
    model2.load_state_dict(template["model"])
    set_optimizer_state_dict(model2, opt2, template["optim"])
    assert opt2._seed == 1
    for x, y in batches[SPLIT:]:
        _step(model2, opt2, x, y)

    for a, b in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert_same_state(flat_state(ref), flat_state(opt2))


def test_dcp_init_step_leaves_parameters_unchanged():
    model = mlp(5)
    before = [p.detach().clone() for p in model.parameters()]
    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, qconfig=CONFIGS / "default.yml", fused=False)
    osd = get_optimizer_state_dict(model, opt)  # runs the lr=0, zero-grad step
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    assert opt.param_groups[0]["lr"] == 1e-3 and all(p.grad is None for p in model.parameters())
    assert set(osd["state"]) == {n for n, _ in model.named_parameters()}


def test_export_from_a_dcp_resumed_optimizer_loads_into_torch(tmp_path):
    model, opt = _make(seed=3)
    for x, y in regression_batches(2, seed=1):
        _step(model, opt, x, y)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path / "c"))
    model2 = mlp(3)
    opt2 = AdamW(model2.named_parameters(), lr=3e-3, qconfig=SR_CFG, fused=False, seed=4)
    opt2.override_quantize_enable(model2[2], "bias", True)
    template = {"optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(template, checkpoint_id=str(tmp_path / "c"))
    set_optimizer_state_dict(model2, opt2, template["optim"])
    sd = export_torch_state_dict(opt2)
    assert all("qconf" not in g for g in sd["param_groups"])
    torch.optim.AdamW(model2.parameters()).load_state_dict(sd)


# -- Muon: the hybrid on a small named model ---------------------------------------------------
#: both parts quantized with stochastic rounding (the seed matters): Muon's momentum 8-bit linear
#: (configs/muon_8bit.yml's map), the AdamW part's exp_avg/exp_avg_sq down to 64 elements
MUON_SR_CFG = {"min_numel": 64,
               "states": {"exp_avg": {"bits": 8, "map": "linear", "group_size": 256, "rounding": "stochastic"},
                          "exp_avg_sq": {"bits": 8, "group_size": 256, "rounding": "stochastic"}}}


class _TinyLM(torch.nn.Module):
    """An embedding and an output head (AdamW by name), two hidden matrices (Muon), biases."""

    def __init__(self, seed: int, vocab: int = 40, d: int = 32):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = torch.nn.Embedding(vocab, d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.wte(tokens)
        return self.lm_head(h + self.fc2(torch.tanh(self.fc1(h))))


def _lm_step(model, opt, tokens):
    opt.zero_grad()
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)).backward()
    opt.step()


def _muon(model, seed, fused):
    return Muon(model.named_parameters(), lr=0.02, adamw={"lr": 3e-3}, qconfig=MUON_SR_CFG, fused=fused, seed=seed)


@pytest.mark.parametrize("fused", [False, None])
def test_dcp_resume_of_the_muon_hybrid_is_bit_identical(tmp_path, fused):
    """The hybrid saved through DCP halfway and loaded into a fresh optimizer (other seed, other
    weights; DCP's zero-grad lr=0 init step first, which must leave the weights alone) continues
    exactly as the run that never stopped: parameters and every state, the seed included."""
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 40, (4, 9), generator=g) for _ in range(STEPS)]
    ref_model = _TinyLM(3)
    ref = _muon(ref_model, 1, fused)
    assert ref.routing() == {"fc1.weight": "muon", "fc2.weight": "muon", "wte.weight": "adamw", "fc1.bias": "adamw",
                             "fc2.bias": "adamw", "lm_head.weight": "adamw"}
    for tokens in batches:
        _lm_step(ref_model, ref, tokens)

    model = _TinyLM(3)
    opt = _muon(model, 1, fused)
    for tokens in batches[:SPLIT]:
        _lm_step(model, opt, tokens)
    osd = get_optimizer_state_dict(model, opt)
    assert {k for entry in osd["state"].values() for k in entry} == {"step", "momentum_buffer", "exp_avg",
                                                                     "exp_avg_sq"}
    assert [g["use_muon"] for g in osd["param_groups"]] == [True, False]
    dcp.save({"model": model.state_dict(), "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))

    model2 = _TinyLM(99)
    opt2 = _muon(model2, 12345, fused)
    before = [p.detach().clone() for p in model2.parameters()]
    template = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    for a, b in zip(before, model2.parameters()):
        assert torch.equal(a, b)  # the init step (lr=0, zero gradients) moved nothing
    dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"))
    model2.load_state_dict(template["model"])
    set_optimizer_state_dict(model2, opt2, template["optim"])
    assert opt2._seed == 1
    assert isinstance(opt2.state[model2.fc1.weight]["momentum_buffer"], QTensor)
    for tokens in batches[SPLIT:]:
        _lm_step(model2, opt2, tokens)

    for a, b in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert_same_state(flat_state(ref), flat_state(opt2))
