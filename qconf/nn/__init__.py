"""BitNet b1.58 training through qconf's codecs (docs/bitnet.md).

    cfg = qconf.load_config({"bitnet": {"enable": True}})
    qconf.nn.insert_rmsnorm_(model, "*", exclude="lm_head")   # optional surgery: its own explicit step
    qconf.nn.quantize_(model, cfg)          # selected nn.Linear -> BitLinear (same Parameters)
    opt = qconf.optim.AdamW(model.named_parameters(), qconfig=cfg)

Modules: ``bitlinear`` (the layer and its autograd function), ``select`` (choosing modules by
name), ``convert`` (``quantize_``), ``surgery`` (RMSNorm insertion, norm removal).
"""
from .bitlinear import BitLinear, bit_linear
from .convert import quantize_
from .surgery import insert_rmsnorm_, is_norm, remove_norms_

__all__ = ["BitLinear", "bit_linear", "quantize_", "insert_rmsnorm_", "remove_norms_", "is_norm"]
