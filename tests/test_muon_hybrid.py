"""qconf.optim.Muon on a whole model: Muon for the hidden matrices, AdamW for the rest, one
optimizer -- routing and refusals, parity with torch.optim.Muon + torch.optim.AdamW, schedulers,
checkpoints, memory_report."""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import qconf
from qconf.codec import QTensor
from qconf.optim import Muon

from helpers import CONFIGS, assert_rel_close

FP32 = CONFIGS / "fp32.yml"


class TinyLM(nn.Module):
    """Embeddings, two hidden matrices with biases, a norm and an output head."""

    def __init__(self, seed=0, vocab=40, d=48):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(vocab, d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.wte(x)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.lm_head(self.ln(h))


def _batches(n, seed=0, vocab=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (4, 9), generator=g) for _ in range(n)]


def _train(model, opts, batches):
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()


HIDDEN = {"fc1.weight", "fc2.weight"}


def test_named_parameters_are_routed_by_shape_and_name():
    opt = Muon(TinyLM().named_parameters())
    assert {n for n, r in opt.routing().items() if r == "muon"} == HIDDEN
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    muon, adamw = opt.param_groups
    assert muon["momentum"] == 0.95 and "betas" not in muon
    assert adamw["betas"] == (0.9, 0.999) and "momentum" not in adamw and "ns_steps" not in adamw


def test_routing_overrides_constructor_then_qconfig():
    cfg = {"overrides": [{"match": "fc2.*", "optimizer": "adamw"}, {"match": "lm_head.*", "optimizer": "muon"}]}
    opt = Muon(TinyLM().named_parameters(), qconfig=cfg, route={"lm_head.*": "adamw", "wte.*": "muon"})
    assert {n for n, r in opt.routing().items() if r == "muon"} == {"fc1.weight", "wte.weight"}


@pytest.mark.parametrize("how", ["route", "qconfig", "group"])
def test_a_parameter_muon_cannot_take_is_refused_by_name(how):
    model = TinyLM()
    if how == "route":
        make = lambda: Muon(model.named_parameters(), route={"fc1.*": "muon"})  # noqa: E731
    elif how == "qconfig":
        make = lambda: Muon(model.named_parameters(), qconfig={"overrides": [{"match": "ln.*", "optimizer": "muon"}]})  # noqa: E731
    else:
        make = lambda: Muon([{"params": list(model.named_parameters()), "use_muon": True}])  # noqa: E731
    with pytest.raises(ValueError, match=r"(fc1\.bias|ln\.weight|wte\.weight).*(routed to Muon|use_muon=True)"):
        make()


def test_plain_tensors_route_by_shape_and_3d_goes_to_adamw():
    mats = [nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(2, 3, 4)),
            nn.Parameter(torch.randn(5, 0))]
    opt = Muon(mats)
    assert opt.routing() == {"0": "muon", "1": "adamw", "2": "adamw", "3": "adamw"}  # (torch's Muon divides by 0)


def _same_grads(models, steps, seed=0):
    """Random gradients, the same for every model's parameter of the same name, step by step."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = {n: torch.randn(p.shape, generator=g) for n, p in models[0].named_parameters()}
        yield [{n: grads[n].clone() for n in grads} for _ in models]


@pytest.mark.parametrize("fused", [True, False])
def test_quantization_off_equals_torch_muon_plus_adamw(fused):
    """On the same gradients: the matrices bit for bit torch.optim.Muon's, the rest within 1e-6 of
    torch.optim.AdamW's (qconf's AdamW parity; through training itself Newton–Schulz's bf16 input
    would amplify AdamW's last-bit differences)."""
    ours, theirs = TinyLM(), TinyLM()
    opt = Muon(ours.named_parameters(), lr=0.02, weight_decay=0.05, adamw={"lr": 3e-3, "weight_decay": 0.01},
               qconfig=FP32, fused=fused)
    hidden = [p for n, p in theirs.named_parameters() if n in HIDDEN]
    rest = [p for n, p in theirs.named_parameters() if n not in HIDDEN]
    pair = [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.05), torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01)]
    for grads in _same_grads([ours, theirs], 20):
        for model, named in zip((ours, theirs), grads):
            for n, p in model.named_parameters():
                p.grad = named[n]
        opt.step()
        for o in pair:
            o.step()
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if n in HIDDEN:
            assert torch.equal(p, q), n
        else:
            assert_rel_close(p, q, 1e-6)


def test_schedulers_scale_both_parts():
    ours, theirs = TinyLM(), TinyLM()
    opt = Muon(ours.named_parameters(), lr=0.02, adamw={"lr": 3e-3}, qconfig=FP32)
    hidden = [p for n, p in theirs.named_parameters() if n in HIDDEN]
    rest = [p for n, p in theirs.named_parameters() if n not in HIDDEN]
    pair = [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]
    lam = lambda step: 1.0 / (1 + step)  # noqa: E731
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lam) for o in (opt, *pair)]
    for grads in _same_grads([ours, theirs], 6, seed=2):
        for model, named in zip((ours, theirs), grads):
            for n, p in model.named_parameters():
                p.grad = named[n]
        for o in (opt, *pair):
            o.step()
        for s in scheds:
            s.step()
    assert [g["lr"] for g in opt.param_groups] == [pair[0].param_groups[0]["lr"], pair[1].param_groups[0]["lr"]]
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if n in HIDDEN:
            assert torch.equal(p, q), n
        else:
            assert_rel_close(p, q, 1e-6)


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("target", ["muon_8bit.yml", "default.yml", "fp32.yml"])
def test_checkpoint_resumes_bit_for_bit_and_moves_between_configs(target):
    model, twin = TinyLM(), TinyLM()
    opt = Muon(model.named_parameters(), lr=0.02, qconfig=CONFIGS / "muon_8bit.yml", seed=3)
    _train(model, [opt], _batches(3))
    sd = _roundtrip(opt.state_dict())
    twin.load_state_dict(model.state_dict())
    other = Muon(twin.named_parameters(), lr=0.02, qconfig=CONFIGS / target, seed=3)
    other.load_state_dict(sd)
    buf = other.state[twin.fc1.weight]["momentum_buffer"]
    assert isinstance(buf, QTensor) == (target != "fp32.yml")
    if target == "muon_8bit.yml":  # the same config: resuming continues exactly
        _train(model, [opt], _batches(2, seed=9))
        _train(twin, [other], _batches(2, seed=9))
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)


def test_a_checkpoint_with_other_routing_is_refused_and_changes_nothing():
    model = TinyLM()
    opt = Muon(model.named_parameters(), qconfig=FP32)
    _train(model, [opt], _batches(1))
    other = Muon(TinyLM().named_parameters(), qconfig=FP32, route={"fc2.*": "adamw"})
    before = other.state_dict()
    with pytest.raises(ValueError, match="load_state_dict") as e:
        other.load_state_dict(opt.state_dict())
    assert "left unchanged" in str(e.value)
    after = other.state_dict()
    assert after["param_groups"] == before["param_groups"] and not other.state


def test_memory_report_counts_one_state_per_muon_matrix():
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False))
    for cfg, low, high in (("muon_8bit.yml", 1.0, 1.05), ("muon_4bit.yml", 0.5, 0.55), ("fp32.yml", 4.0, 4.0)):
        report = qconf.memory_report(Muon(model.named_parameters(), qconfig=CONFIGS / cfg))
        assert low <= report.bytes_per_param <= high


def test_export_to_torch_is_refused_with_the_reason():
    opt = Muon(TinyLM().named_parameters())
    with pytest.raises(ValueError, match="two torch optimizers"):
        qconf.optim.export_torch_state_dict(opt)
