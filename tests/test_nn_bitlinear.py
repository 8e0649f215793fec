"""qconf.nn.BitLinear against BitNet b1.58's official formulas, written here independently of the
codecs: the forward bit for bit (the integer product computed exactly in float64), the
straight-through gradients bit for bit, the bytes saved for backward, bf16 / autocast /
torch.compile, the integer-product paths, and training with qconf's optimizers."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import qconf
from qconf.config import BitNetConfig
from qconf.nn import BitLinear, bit_linear
from qconf.nn import bitlinear as bl
from qconf.memory import saved_bytes
from qconf.ops import ternary_mm_available


# -- the reference: BitNet's "Training Tips, Code and FAQ" quantizers --------------------------------------
def ref_activations(x2d: torch.Tensor, bits: int = 8, eps: float = 1e-5):
    """scale = 127 / max|row| (clamped), q = round(x * scale) clamped; fp32 (BitNet's code)."""
    mrq = 2 ** (bits - 1) - 1
    scale = mrq / x2d.abs().max(dim=-1, keepdim=True).values.clamp(min=eps)
    return (x2d * scale).round().clamp(-mrq - 1, mrq), scale


def ref_weights(w: torch.Tensor, eps: float = 1e-5):
    """scale = 1 / mean|W| (clamped), q = round(W * scale) clamped to [-1, 1]."""
    scale = 1.0 / w.abs().mean().clamp(min=eps)
    return (w * scale).round().clamp(-1, 1), scale


def ref_forward(x, w, b, bits=8, weps=1e-5, aeps=1e-5, out_dtype=None):
    """y = (Xq @ Wq^T) / (scale_x * scale_w) + b, with the integer product exact (float64 of integers)."""
    x2 = x.detach().float().reshape(-1, x.shape[-1])
    qx, sx = ref_activations(x2, bits, aeps)
    qw, sw = ref_weights(w.detach().float(), weps)
    acc = (qx.double() @ qw.double().t()).float()
    y = acc / (sx * sw)
    if b is not None:
        y = y + b.detach().float()
    return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], w.shape[0])


def ref_grads(x, w, g, bits=8, weps=1e-5, aeps=1e-5):
    """The STE: grad_x = g @ (Wq / scale_w), grad_W = g^T @ (Xq / scale_x), grad_b = sum g (fp32)."""
    x2 = x.detach().float().reshape(-1, x.shape[-1])
    qx, sx = ref_activations(x2, bits, aeps)
    qw, sw = ref_weights(w.detach().float(), weps)
    g2 = g.float().reshape(-1, g.shape[-1])
    return ((g2 @ (qw / sw)).reshape(x.shape), g2.t() @ (qx / sx), g2.sum(0))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def make(k, n, bias=True, dtype=torch.float32, seed=0, config=None):
    torch.manual_seed(seed)
    m = BitLinear(k, n, bias=bias, dtype=dtype, config=config)
    with torch.no_grad():
        m.weight.mul_(3.0)  # weights of varied magnitude: many +-1 and 0 levels
        if bias:
            m.bias.normal_()
    return m


SHAPES = [((7, 33), 10), ((2, 5, 24), 16), ((64, 128), 96), ((1, 1), 1), ((0, 8), 4)]


@pytest.mark.parametrize("xshape, n", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_ste_gradients_equal_the_official_formulas(xshape, n, bias):
    m = make(xshape[-1], n, bias)
    torch.manual_seed(1)
    x = (torch.randn(xshape) * torch.rand(xshape[:-1] + (1,)) * 4).requires_grad_()
    if x.numel():
        x.data[(0,) * (x.dim() - 1)].zero_()  # an all-zero row: its scale is eps
    y = m(x)
    assert same(y, ref_forward(x, m.weight, m.bias))
    g = torch.randn_like(y)
    y.backward(g)
    gx, gw, gb = ref_grads(x, m.weight, g)
    assert same(x.grad, gx) and same(m.weight.grad, gw)
    assert (m.bias is None) if not bias else same(m.bias.grad, gb)


def test_config_fields_reach_the_forward():
    cfg = BitNetConfig(weight_eps=0.5, activation_eps=2.0, activation_bits=4)
    m = make(40, 12, config=cfg)
    x = torch.randn(9, 40) * 0.3  # rows with max|x| < activation_eps and a weight absmean < weight_eps
    assert same(m(x), ref_forward(x, m.weight, m.bias, bits=4, weps=0.5, aeps=2.0))


def test_bf16_weights_inputs_and_autocast():
    m = make(48, 20, dtype=torch.bfloat16)
    x = torch.randn(6, 48, dtype=torch.bfloat16, requires_grad=True)
    y = m(x)  # quantized from the exact fp32 values of the bf16 tensors, computed in fp32, returned in bf16
    assert same(y, ref_forward(x, m.weight, m.bias))
    y.float().sum().backward()
    assert x.grad.dtype == m.weight.grad.dtype == m.bias.grad.dtype == torch.bfloat16
    gx, gw, gb = ref_grads(x, m.weight, torch.ones(6, 20, dtype=torch.bfloat16))
    assert same(x.grad, gx.bfloat16()) and same(m.weight.grad, gw.bfloat16()) and same(m.bias.grad, gb.bfloat16())

    m32 = make(48, 20)
    x32 = torch.randn(3, 4, 48, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m32(x32)
        ref = nn.functional.linear(x32, m32.weight, m32.bias)
    assert y.dtype == ref.dtype == torch.bfloat16
    assert same(y, ref_forward(x32, m32.weight, m32.bias, out_dtype=torch.bfloat16))
    y.float().sum().backward()
    assert x32.grad.dtype == m32.weight.grad.dtype == torch.float32
    gx, gw, _ = ref_grads(x32, m32.weight, torch.ones(3, 4, 20, dtype=torch.bfloat16))
    assert same(x32.grad, gx) and same(m32.weight.grad, gw)


def test_saved_activations_are_a_third_of_fp32_linear_or_less():
    k, n, rows = 512, 1024, 256
    x = torch.randn(rows, k, requires_grad=True)
    bit, ref = make(k, n), nn.Linear(k, n)
    (got_total, got), (fp32_total, fp32) = saved_bytes(bit, x), saved_bytes(ref, x)
    # BitLinear: int8 input levels + fp32 row scales + the fp32 weight scale (and the weight
    # Parameter by reference); nn.Linear: the fp32 input (and the weight by reference)
    assert got == rows * k + 4 * rows + 4 and got_total == got + 4 * n * k
    assert fp32 == 4 * rows * k and fp32_total == fp32 + 4 * n * k
    assert 3 * got <= fp32


def test_integer_product_paths_are_exact(monkeypatch):
    torch.manual_seed(0)
    a = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    b = torch.randint(-1, 2, (24, 64), dtype=torch.int8)
    exact = (a.long() @ b.long().t()).float()
    assert bl._uses_ternary_mm(a, 1) == ternary_mm_available() and not bl._uses_ternary_mm(a, 2)
    assert same(bl.integer_matmul(a, b, 127, 1), exact)  # qconf's AVX2 kernel (here)
    monkeypatch.setattr(bl, "_TERNARY_MM", False)
    assert same(bl.integer_matmul(a, b, 127, 1), exact)  # fp32 GEMM of the levels
    assert same(bl.integer_matmul(a, b, 127, 1 << 17), exact)  # float64 beyond the fp32-exact bound
    monkeypatch.setattr(bl, "_CPU_INT_MM_FAST", True)
    assert bl._uses_int_mm(a, b)
    assert same(bl.integer_matmul(a, b, 127, 1), exact)  # torch._int_mm
    big = torch.full((2, 4), 127, dtype=torch.int8), torch.full((3, 4), 127, dtype=torch.int8)
    monkeypatch.setattr(bl, "_FP32_EXACT", 8)  # pretend K is past the fp32 bound: rounds once, like int32 -> fp32
    monkeypatch.setattr(bl, "_CPU_INT_MM_FAST", False)
    assert same(bl.integer_matmul(*big, 127, 127), torch.full((2, 3), 4 * 127 * 127.0))


@pytest.mark.skipif(not ternary_mm_available(), reason="needs AVX2")
def test_ternary_kernel_gives_the_fp32_paths_bits(monkeypatch):
    """The whole layer, forward and backward, is the same with and without qconf's int8 kernel."""
    torch.manual_seed(3)
    m = make(300, 130)
    x = torch.randn(5, 67, 300) * 3
    runs = []
    for kernel in (True, False):
        monkeypatch.setattr(bl, "_TERNARY_MM", kernel)
        xi = x.clone().requires_grad_()
        m.zero_grad()
        y = m(xi)
        y.backward(torch.cos(y))
        runs.append((y.detach(), xi.grad, m.weight.grad.clone(), m.bias.grad.clone()))
    assert all(same(a, b) for a, b in zip(*runs))


def test_functional_and_errors():
    m = make(16, 8)
    x = torch.randn(3, 16)
    assert same(bit_linear(x, m.weight, m.bias, m.weight_codec, m.activation_codec), m(x))
    with pytest.raises(ValueError, match="input has 15 features in its last dimension, the weight expects 16"):
        m(torch.randn(3, 15))
    with pytest.raises(TypeError, match="floating"):
        m(torch.ones(3, 16, dtype=torch.int64))
    assert "ternary absmean" in repr(m) and "levels +-127" in repr(m)
    assert list(m.state_dict()) == ["weight", "bias"] and isinstance(m, nn.Linear)


def test_torch_compile_matches_eager():
    """torch.compile (inductor) of forward + backward runs and agrees with eager to a few fp32 ulps of
    the largest term (rtol = atol = 1e-5 for outputs of order 1): inductor sums the weights' absmean in
    its own order, so the weight scale may differ in its last bits (a weight within those bits of a
    rounding boundary could change level; none does here). The activation levels, the integer product
    and so grad_W are the same bits."""
    torch._dynamo.reset()
    m = make(32, 24)
    x = torch.randn(2, 9, 32)
    compiled = torch.compile(m, fullgraph=True)  # one graph: no graph break anywhere
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye, yc = m(xe), compiled(xc)
    g = torch.randn_like(ye)
    ye.backward(g)
    we = m.weight.grad.clone()
    m.weight.grad = None
    yc.backward(g)
    torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-5)
    assert same(m.weight.grad, we)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb, yb_eager = compiled(x), m(x)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, yb_eager)  # bf16 tolerances: the fp32 ulps above may cross a bf16 rounding


class Tiny(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.fc1, self.fc2 = BitLinear(32, 64, dtype=dtype), BitLinear(64, 4, dtype=dtype)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("dtype, qconfig", [
    (torch.float32, "default"),
    (torch.bfloat16, {"min_numel": 0, "weights": {"rounding": "stochastic"}}),  # 4-bit states, SR bf16 writes
], ids=["fp32", "bf16-stochastic"])
def test_qconf_adamw_trains_bitlinear(dtype, qconfig):
    torch.manual_seed(0)
    model = Tiny(dtype)
    x = torch.randn(256, 32, dtype=dtype)
    y = (x.float() @ (torch.randn(32, 4) / 32 ** 0.5)).to(dtype)  # a linear target of unit variance
    opt = qconf.optim.AdamW(model.named_parameters(), lr=1e-2, qconfig=qconfig, fused=None)
    losses = []
    for _ in range(40):
        loss = (model(x).float() - y.float()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == dtype for p in model.parameters())
    assert losses[-1] < 0.2 * losses[0], losses  # measured: ~0.05 and ~0.07 of the start
