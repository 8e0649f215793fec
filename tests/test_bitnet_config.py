"""The qconfig's ``bitnet:`` section (qconf.config.bitnet): defaults, validation with one line per
problem, ``base`` merging, round trips, ``qconf show`` and the two codecs it describes."""
from __future__ import annotations

import pickle

import pytest
import torch
import yaml

from qconf.cli import main
from qconf.codec import Codec
from qconf.config import BitNetConfig, QConfig, load_config
from qconf.config.bitnet import DEFAULT_EXCLUDE
from qconf.errors import QConfigError


def write(path, text):
    path.write_text(text)
    return path


def problems(src):
    with pytest.raises(QConfigError) as e:
        load_config(src)
    return e.value.problems


def test_defaults_and_selection():
    b = load_config({}).bitnet
    assert b == BitNetConfig() and b.enable is False
    assert b.modules == ("*",) and b.exclude == DEFAULT_EXCLUDE == ("lm_head", "*.lm_head", "head", "*.head")
    assert (b.weight_eps, b.activation_eps, b.activation_bits) == (1e-5, 1e-5, 8)
    assert b.selects("layers.0.attn.q_proj") and b.selects("fc")
    assert not b.selects("lm_head") and not b.selects("model.lm_head") and not b.selects("head")
    assert b.selects("heads.0") and b.selects("lm_head_extra")  # globs match whole names only
    c = BitNetConfig(modules=["re:layers\\.\\d+\\.mlp\\..*", "out"], exclude=["*.fc2"])
    assert c.modules == ("re:layers\\.\\d+\\.mlp\\..*", "out") and isinstance(c.exclude, tuple)
    assert c.selects("layers.3.mlp.fc1") and c.selects("out")
    assert not c.selects("layers.3.mlp.fc2") and not c.selects("layers.3.attn.q") and not c.selects("outer")
    assert hash(c) == hash(BitNetConfig(modules=("re:layers\\.\\d+\\.mlp\\..*", "out"), exclude=("*.fc2",)))
    assert pickle.loads(pickle.dumps(c)) == c and pickle.loads(pickle.dumps(c)).selects("out")


def test_codecs_are_bitnets():
    b = BitNetConfig(weight_eps=2e-5, activation_eps=3e-5, activation_bits=6)
    assert b.weight_codec() == Codec(bits=2, map="ternary", signed=True, scale="tensor", statistic="absmean",
                                     rounding="nearest-even", min_scale=2e-5)
    assert b.activation_codec() == Codec(bits=6, map="linear", signed=True, scale="dim0", statistic="absmax",
                                         rounding="nearest-even", min_scale=3e-5)
    levels, scales = b.activation_codec().encode_integers(torch.tensor([[100.0, -0.5, 31.0]]))
    assert levels.tolist() == [[31, 0, 10]] and scales.tolist() == [100.0]  # MRQ = 2**5 - 1


def test_to_dict_round_trip_and_default_omitted(tmp_path):
    assert "bitnet" not in load_config({}).to_dict()  # configs without BitNet dump as before
    assert "bitnet" not in load_config({"bitnet": {"enable": False}}).to_dict()
    cfg = load_config({"bitnet": {"enable": True, "modules": ["layers.*"], "exclude": [],
                                  "weight_eps": 1e-6, "activation_eps": 2, "activation_bits": 4}})
    d = cfg.to_dict()
    assert list(d)[-1] == "bitnet"
    assert d["bitnet"] == {"enable": True, "modules": ["layers.*"], "exclude": [], "weight_eps": 1e-6,
                           "activation_eps": 2.0, "activation_bits": 4, "latent_dtype": "keep"}
    assert isinstance(d["bitnet"]["activation_eps"], float)
    assert load_config(d) == cfg
    assert load_config(yaml.safe_load(cfg.to_yaml())) == cfg
    assert load_config(write(tmp_path / "dumped.yml", cfg.to_yaml())) == cfg
    assert cfg != load_config({}) and cfg == QConfig(bitnet=BitNetConfig(**d["bitnet"]))
    assert QConfig(bitnet={"enable": True}).bitnet == BitNetConfig(enable=True)


def test_base_merges_field_by_field(tmp_path):
    write(tmp_path / "base.yml", "bitnet:\n  enable: true\n  modules: ['a.*', 'b']\n  weight_eps: 1.0e-4\n")
    top = write(tmp_path / "top.yml", "base: base.yml\nbitnet:\n  modules: ['c']\n  activation_bits: 4\n")
    b = load_config(top).bitnet
    assert b == BitNetConfig(enable=True, modules=("c",), weight_eps=1e-4, activation_bits=4)  # a list replaces
    assert load_config(write(tmp_path / "off.yml", "base: base.yml\nbitnet: {enable: false}\n")).bitnet.enable is False


@pytest.mark.parametrize("text, key, words", [
    ("bitnet:\n  enabel: true\n", "bitnet.enabel", ["unknown key 'enabel'", "did you mean 'enable'?"]),
    ("bitnet:\n  activation_bit: 8\n", "bitnet.activation_bit", ["did you mean 'activation_bits'?"]),
    ("bitnett: {}\n", "bitnett", ["unknown key", "did you mean 'bitnet'?"]),
    ("bitnet: [1]\n", "bitnet", ["expected a mapping"]),
    ("bitnet:\n  enable: 1\n", "bitnet.enable", ["is not a boolean"]),
    ("bitnet:\n  weight_eps: 0.0\n", "bitnet.weight_eps", ["0.0 is out of range", "> 0"]),
    ("bitnet:\n  weight_eps: -1.0e-5\n", "bitnet.weight_eps", ["out of range"]),
    ("bitnet:\n  activation_eps: 0\n", "bitnet.activation_eps", ["0 is out of range"]),
    ("bitnet:\n  activation_eps: .nan\n", "bitnet.activation_eps", ["out of range"]),
    ("bitnet:\n  activation_eps: .inf\n", "bitnet.activation_eps", ["out of range"]),
    ("bitnet:\n  weight_eps: 1e-5\n", "bitnet.weight_eps", ["is not a number", "write 1.0e-5"]),
    ("bitnet:\n  weight_eps: true\n", "bitnet.weight_eps", ["true is not a number"]),
    ("bitnet:\n  activation_bits: 9\n", "bitnet.activation_bits", ["9 is out of range", "integer 2..8"]),
    ("bitnet:\n  activation_bits: 1\n", "bitnet.activation_bits", ["out of range"]),
    ("bitnet:\n  activation_bits: 8.0\n", "bitnet.activation_bits", ["is not an integer"]),
    ("bitnet:\n  modules: '*'\n", "bitnet.modules", ["expected a list, got a string"]),
    ("bitnet:\n  modules: []\n", "bitnet.modules", ["empty list", "one or more"]),
    ("bitnet:\n  exclude: [3]\n", "bitnet.exclude[0]", ["3 is not a string"]),
    ("bitnet:\n  modules: ['re:(']\n", "bitnet.modules[0]", ["does not compile"]),
    ("bitnet:\n  modules: ['a', 'b[c']\n", "bitnet.modules[1]", ["unclosed '['"]),
])
def test_errors_name_the_key(tmp_path, text, key, words):
    path = write(tmp_path / "bad.yml", text)
    found = problems(path)
    assert len(found) == 1
    assert found[0].key_path == key and found[0].file == str(path)
    line = str(found[0])
    assert "\n" not in line and all(w in line for w in words), line


def test_every_problem_reported_and_constructor_validates():
    found = problems({"bitnet": {"weight_eps": 0, "activation_bits": 1, "modules": [], "enable": "no"}})
    assert [p.key_path for p in found] == ["bitnet.weight_eps", "bitnet.activation_bits", "bitnet.modules",
                                           "bitnet.enable"]
    with pytest.raises(QConfigError, match=r"<BitNetConfig>: activation_eps: -1 is out of range"):
        BitNetConfig(activation_eps=-1)
    with pytest.raises(QConfigError, match=r"<QConfig>: bitnet: expected a BitNetConfig or a mapping, got a string"):
        QConfig(bitnet="on")
    with pytest.raises(QConfigError, match=r"<QConfig>: bitnet.exclude: expected a list"):
        QConfig(bitnet={"exclude": "lm_head"})


def test_show_prints_the_section(capsys, tmp_path):
    path = write(tmp_path / "b.yml", "base: default\nbitnet:\n  enable: true\n  exclude: [lm_head]\n")
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    section = yaml.safe_load(out)["bitnet"]
    assert section == {"enable": True, "modules": ["*"], "exclude": ["lm_head"], "weight_eps": 1e-5,
                       "activation_eps": 1e-5, "activation_bits": 8, "latent_dtype": "keep"}
    assert main(["show", str(path), "--json"]) == 0
    import json
    assert json.loads(capsys.readouterr().out)["config"]["bitnet"] == section


def test_optimizer_checkpoints_keep_the_section():
    import qconf
    cfg = {"bitnet": {"enable": True, "exclude": ["out"]}}
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = qconf.optim.AdamW([p], qconfig=cfg)
    p.grad = torch.randn(8, 8)
    opt.step()
    sd = opt.state_dict()
    assert load_config(sd["param_groups"][0]["qconf"]["qconfig"]).bitnet == BitNetConfig(enable=True, exclude=("out",))
    fresh = qconf.optim.AdamW([torch.nn.Parameter(torch.zeros(8, 8))], qconfig=cfg)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.state_dict()["state"][0]["step"], sd["state"][0]["step"])
