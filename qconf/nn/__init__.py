"""BitNet b1.58 training through qconf's codecs (docs/bitnet.md).

    cfg = qconf.load_config({"bitnet": {"enable": True}})
    qconf.nn.insert_rmsnorm_(model, "*", exclude="lm_head")   # optional surgery: its own explicit step
    qconf.nn.quantize_(model, cfg)          # selected nn.Linear -> BitLinear (same Parameters)
    opt = qconf.optim.AdamW(model.named_parameters(), qconfig=cfg)
    ...                                     # train
    exported = qconf.nn.export_bitnet(model)  # 2-bit packed ternary weights; torch.save it
    qconf.nn.load_bitnet(same_arch_model, exported)  # BitLinear -> BitLinearInference

Modules: ``bitlinear`` (the layer and its autograd function), ``select`` (choosing modules by
name), ``convert`` (``quantize_``), ``surgery`` (RMSNorm insertion, norm removal), ``export``
(packed export, inference layers, sizes).
"""
from .bitlinear import BitLinear, bit_linear
from .convert import quantize_
from .export import BitLinearInference, BitNetSizes, bitnet_sizes, export_bitnet, load_bitnet
from .surgery import insert_rmsnorm_, is_norm, remove_norms_

__all__ = ["BitLinear", "bit_linear", "quantize_", "insert_rmsnorm_", "remove_norms_", "is_norm",
           "BitLinearInference", "export_bitnet", "load_bitnet", "bitnet_sizes", "BitNetSizes"]
