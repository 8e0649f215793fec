"""qconf.nn.export_bitnet / load_bitnet / bitnet_sizes: the 2-bit packed export, loaded with
torch.load(weights_only=True), gives inference layers whose forward equals the training forward
bit for bit; a mismatched model is refused and left as it was; every byte is counted."""
from __future__ import annotations

import io
import math
import re

import pytest
import torch

import qconf
from qconf.nn import BitLinear, BitLinearInference, bitnet_sizes, export_bitnet, load_bitnet, quantize_
from test_nn_convert import IDS, ON, Model, model, tree, unchanged


# -- export / load -------------------------------------------------------------------------------
def trained(seed=0):
    m = model(seed)
    quantize_(m, ON)
    opt = qconf.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(3):
        loss = m(IDS).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m


def test_export_load_forward_equals_training_forward_bit_for_bit():
    m = trained()
    exported = export_bitnet(m)
    buf = io.BytesIO()
    torch.save(exported, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    layer = loaded["layers"]["layers.0.fc1"]
    assert layer["weight"]["codes"].dtype == torch.uint8 and layer["weight"]["codes"].numel() == math.ceil(32 * 16 / 4)
    assert layer["weight"]["scales"].shape == (1,) and layer["weight"]["shape"] == [32, 16]
    assert "layers.0.fc1.weight" not in loaded["state"] and "layers.0.fc1.bias" in loaded["state"]
    assert "lm_head.weight" in loaded["state"] and "embed.weight" in loaded["state"]
    fresh = model(seed=5)
    quantize_(fresh, ON)
    assert load_bitnet(fresh, loaded) == sorted(loaded["layers"])
    assert isinstance(fresh.layers[1].fc2, BitLinearInference) and fresh.layers[1].fc2.bias is None
    with torch.no_grad():
        ids = torch.randint(0, 11, (4, 7))
        assert torch.equal(fresh(ids), m(ids))
        x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
        assert torch.equal(fresh.layers[0].fc1(x), m.layers[0].fc1(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(fresh(ids), m(ids))
    assert torch.equal(fresh.layers[0].q.weight_qtensor().decode(),
                       m.layers[0].q.weight_codec.decode_integers(*m.layers[0].q.weight_codec.encode_integers(
                           m.layers[0].q.weight.detach())))


def test_load_errors_leave_the_model_unchanged():
    exported = export_bitnet(trained())
    unconverted, narrow, fewer = model(), Model(d=8), model()
    quantize_(narrow, ON)
    quantize_(fewer, {"bitnet": {"enable": True, "modules": ["layers.0.*"]}})
    bigger = model()
    quantize_(bigger, {"bitnet": {"enable": True, "exclude": []}})
    for target, words in [
        (unconverted, "exported layers that are not BitLinear modules of the model: layers.0.fc1, "),
        (narrow, "layer 'layers.0.fc1': exported weight shape (32, 16), model (16, 8)"),
        (fewer, "exported layers that are not BitLinear modules of the model: layers.1.fc1, "),
        (bigger, "BitLinear modules with no exported weights: lm_head"),
    ]:
        before = tree(target)
        with pytest.raises(ValueError, match=re.escape(words)):
            load_bitnet(target, exported)
        assert unchanged(target, before)
    partial = model()
    quantize_(partial, ON)
    broken = {**exported, "state": {k: v for k, v in exported["state"].items() if k != "embed.weight"}}
    before = tree(partial)
    with pytest.raises(ValueError, match="missing state entries: embed.weight"):
        load_bitnet(partial, broken)
    with pytest.raises(ValueError, match="not a qconf.bitnet version 1 export"):
        load_bitnet(partial, {"layers": {}})
    assert unchanged(partial, before)
    with pytest.raises(ValueError, match="has no BitLinear"):
        export_bitnet(model())


def test_sizes_count_every_byte():
    m = trained()
    exported = export_bitnet(m)
    s = bitnet_sizes(exported)
    lin = [mod for mod in m.modules() if isinstance(mod, BitLinear)]
    numel = sum(mod.weight.numel() for mod in lin)
    assert s.linear_numel == numel
    assert s.linear_packed_bytes == sum(math.ceil(mod.weight.numel() / 4) + 4 for mod in lin)
    rest = [v for k, v in m.state_dict().items() if not any(k == f"{n}.weight" for n, mod in m.named_modules()
                                                               if isinstance(mod, BitLinear))]
    assert s.other_numel == sum(t.numel() for t in rest) and s.other_bytes == 4 * s.other_numel
    assert s.fp32_bytes() == 4 * (numel + s.other_numel) and s.bf16_bytes() == 2 * (numel + s.other_numel)
    assert s.fp32_bytes(linear_only=True) == 4 * numel and s.packed_bytes == s.linear_packed_bytes + s.other_bytes
    table = s.table()
    assert "linear weights" in table and "whole model" in table


def test_tied_tensors_are_exported_and_counted_once():
    m = model()
    m.lm_head.weight = m.embed.weight  # tied embedding and head (the head stays full precision)
    quantize_(m, ON)
    exported = export_bitnet(m)
    assert exported["state"]["lm_head.weight"] is exported["state"]["embed.weight"]
    buf = io.BytesIO()
    torch.save(exported, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert bitnet_sizes(loaded) == bitnet_sizes(exported)
    assert bitnet_sizes(exported).other_numel == sum(t.numel() for k, t in exported["state"].items()
                                                     if k != "lm_head.weight")
