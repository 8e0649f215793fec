"""qconf.nn.quantize_ (conversion) and insert_rmsnorm_ / remove_norms_ (surgery): what they change,
and that every error leaves the model as it was."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import qconf
from qconf.config import BitNetConfig
from qconf.errors import QConfigError
from qconf.nn import BitLinear, insert_rmsnorm_, quantize_, remove_norms_

ON = {"bitnet": {"enable": True}}


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.fc2(torch.relu(self.fc1(h))) + self.q(h)


class Model(nn.Module):
    def __init__(self, d=16, vocab=11):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.final_norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.final_norm(h))


def model(seed=0):
    torch.manual_seed(seed)
    return Model()


def tree(m: nn.Module):
    """The module tree and the state dict, for before/after comparisons."""
    return [(n, type(s)) for n, s in m.named_modules()], {k: v.clone() for k, v in m.state_dict().items()}


def unchanged(m, before):
    names, state = tree(m)
    return names == before[0] and state.keys() == before[1].keys() and all(
        torch.equal(state[k], before[1][k]) for k in state)


IDS = torch.randint(0, 11, (3, 5))


# -- quantize_ -----------------------------------------------------------------------------------
def test_quantize_converts_selected_linears_keeping_parameters():
    m = model()
    params = dict(m.named_parameters())
    keys = list(m.state_dict())
    ref = m(IDS)
    opt = qconf.optim.AdamW(m.parameters(), lr=1e-2)  # built before the conversion
    names = quantize_(m, ON)
    assert names == ["layers.0.q", "layers.0.fc1", "layers.0.fc2", "layers.1.q", "layers.1.fc1", "layers.1.fc2"]
    assert all(type(m.get_submodule(n)) is BitLinear for n in names)
    assert type(m.lm_head) is nn.Linear and type(m.embed) is nn.Embedding  # excluded head; not a Linear
    assert list(m.state_dict()) == keys and all(p is params[k] for k, p in m.named_parameters())
    out = m(IDS)
    assert out.shape == ref.shape and not torch.equal(out, ref)  # the forward is quantized now
    before = m.layers[0].fc1.weight.clone()
    out.square().mean().backward()
    opt.step()
    assert not torch.equal(m.layers[0].fc1.weight, before)  # the old optimizer steps the same Parameters


def test_selectors_and_config_forms(tmp_path):
    m = model()
    assert quantize_(m, {"bitnet": {"enable": True, "modules": ["re:layers\\.1\\..*", "layers.0.q"],
                                    "exclude": ["*.fc2"]}}) == ["layers.0.q", "layers.1.q", "layers.1.fc1"]
    path = tmp_path / "b.yml"
    path.write_text("bitnet:\n  enable: true\n  modules: [lm_head]\n  exclude: []\n")
    m = model()
    assert quantize_(m, str(path)) == ["lm_head"]
    m = model()
    assert quantize_(m, BitNetConfig(enable=True, modules=("*.fc1",))) == ["layers.0.fc1", "layers.1.fc1"]
    cfg = BitNetConfig(enable=True, modules=("layers.0.fc1",), weight_eps=1e-3, activation_bits=4)
    m = model()
    quantize_(m, qconf.load_config({"bitnet": {**cfg.to_dict()}}))
    assert m.layers[0].fc1.weight_codec == cfg.weight_codec()
    assert m.layers[0].fc1.activation_codec == cfg.activation_codec()


@pytest.mark.parametrize("config, error, words", [
    ({}, QConfigError, ["bitnet.enable", "not enabled"]),
    ({"bitnet": {"enable": True, "modules": ["layers.0.norm"]}}, ValueError,
     ["bitnet.modules[0] 'layers.0.norm'", "is a LayerNorm (wanted: nn.Linear)"]),
    ({"bitnet": {"enable": True, "modules": ["layers.9.q"]}}, ValueError, ["no module named 'layers.9.q'"]),
    ({"bitnet": {"enable": True, "modules": ["lm_head"]}}, ValueError, ["'lm_head' is excluded by bitnet.exclude"]),
    ({"bitnet": {"enable": True, "modules": ["*.attn.*"]}}, ValueError,
     ["bitnet.modules[0] '*.attn.*' selects no nn.Linear module (matched, not excluded: none)"]),
    ({"bitnet": {"enable": True, "modules": ["*norm"]}}, ValueError, ["selects no nn.Linear", "layers.0.norm (LayerNorm)"]),
    ({"bitnet": {"enable": True, "modules": ["*.q", "layers.0.norm", "nothing*"]}}, ValueError,
     ["modules[1] 'layers.0.norm'", "modules[2] 'nothing*'"]),  # every problem, one line each
])
def test_conversion_errors_leave_the_model_unchanged(config, error, words):
    m = model()
    before = tree(m)
    with pytest.raises(error) as e:
        quantize_(m, config)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert unchanged(m, before)


def test_converting_twice_is_an_error():
    m = model()
    quantize_(m, {"bitnet": {"enable": True, "modules": ["layers.0.*"]}})
    before = tree(m)
    with pytest.raises(ValueError, match=r"module 'layers.0.q' is already a BitLinear \(quantize_ converts a module"):
        quantize_(m, ON)
    assert unchanged(m, before) and type(m.layers[1].q) is nn.Linear


def test_linear_subclasses_are_left_with_a_warning_and_shared_modules_move_together():
    m = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    with pytest.warns(UserWarning, match=r"leaves subclasses of nn.Linear.*0.out_proj \(NonDynamicallyQuantizableLinear"):
        assert quantize_(m, ON) == ["1"]
    with pytest.raises(ValueError, match="is a NonDynamicallyQuantizableLinear"):
        quantize_(nn.Sequential(nn.MultiheadAttention(8, 2)), {"bitnet": {"enable": True, "modules": ["0.out_proj"]}})
    shared = nn.Linear(4, 4)
    m = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quantize_(m, ON) == ["a"]
    assert m["a"] is m["b"][0] and isinstance(m["a"], BitLinear)
    m = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    with pytest.raises(ValueError, match=r"module 'a' is also registered as 'b.0', which the patterns do not select"):
        quantize_(m, {"bitnet": {"enable": True, "modules": ["a"]}})


# -- surgery -------------------------------------------------------------------------------------
def test_insert_rmsnorm_wraps_each_selected_linear():
    m = model()
    ref_fc1 = m.layers[0].fc1
    names = insert_rmsnorm_(m, "*", exclude="lm_head")
    assert names == ["layers.0.q", "layers.0.fc1", "layers.0.fc2", "layers.1.q", "layers.1.fc1", "layers.1.fc2"]
    seq = m.layers[0].fc1
    assert isinstance(seq, nn.Sequential) and seq[1] is ref_fc1 and isinstance(seq[0], nn.RMSNorm)
    assert seq[0].eps == 1e-5 and seq[0].normalized_shape == (16,) and seq[0].weight.dtype == torch.float32
    keys = set(m.state_dict())
    assert {"layers.0.fc1.0.weight", "layers.0.fc1.1.weight", "layers.0.fc1.1.bias"} <= keys
    assert "layers.0.fc1.weight" not in keys and "lm_head.weight" in keys
    x = torch.randn(4, 16)
    assert torch.equal(seq(x), ref_fc1(nn.functional.rms_norm(x, (16,), seq[0].weight, 1e-5)))
    assert quantize_(m, ON)[0] == "layers.0.q.1"  # conversion finds the wrapped linears
    before = tree(m)
    with pytest.raises(ValueError, match=r"already preceded by an inserted RMSNorm.*layers.0.q.1"):
        insert_rmsnorm_(m, "*", exclude="lm_head")
    assert unchanged(m, before)
    m2 = nn.Sequential(nn.Linear(4, 4, dtype=torch.bfloat16))
    insert_rmsnorm_(m2, "0", eps=None)
    assert m2[0][0].eps is None and m2[0][0].weight.dtype == torch.bfloat16


def test_remove_norms_and_surgery_errors():
    m = model()
    assert remove_norms_(m, "layers.*.norm") == ["layers.0.norm", "layers.1.norm"]
    assert isinstance(m.layers[0].norm, nn.Identity) and "layers.0.norm.weight" not in m.state_dict()
    m = model()
    before = tree(m)
    for call, words in [
        (lambda: remove_norms_(m, ["layers.0.q"]), "module 'layers.0.q' is a Linear (wanted: normalization)"),
        (lambda: remove_norms_(m, "*.fc*"), "selects no normalization module"),
        (lambda: insert_rmsnorm_(m, ["layers.0.norm"]), "is a LayerNorm (wanted: nn.Linear or BitLinear)"),
        (lambda: insert_rmsnorm_(m, ["*.q", "missing"]), "no module named 'missing'"),
        (lambda: insert_rmsnorm_(m, "re:("), "modules[0]: regex '(' does not compile"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            call()
        assert unchanged(m, before)


def test_latent_dtype_casts_the_converted_layers_in_place():
    m = model()
    params = dict(m.named_parameters())
    names = quantize_(m, {"bitnet": {"enable": True, "latent_dtype": "bfloat16"}})
    for n in names:
        layer = m.get_submodule(n)
        assert layer.weight.dtype == torch.bfloat16 and layer.weight is params[f"{n}.weight"]
        assert layer.bias is None or layer.bias.dtype == torch.bfloat16
    assert m.lm_head.weight.dtype == torch.float32 and m.embed.weight.dtype == torch.float32  # not converted
    out = m(IDS)  # fp32 activations through bf16 latent weights: the output keeps the input's dtype
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    out.square().mean().backward()
    assert m.layers[0].fc1.weight.grad.dtype == torch.bfloat16
    with pytest.raises(QConfigError, match="latent_dtype"):
        quantize_(model(), {"bitnet": {"enable": True, "latent_dtype": "float16"}})
