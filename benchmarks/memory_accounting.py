"""Training bytes per parameter of each combination of parameter dtype, weight update mode and state
config, with and without gradient release, from ``qconf.memory_report`` (no training: the plan's
bytes, which equal the states' once they exist). One 4096x4096 parameter stands for a large model,
where the small tensors kept in fp32 (below ``min_numel``) do not count. docs/memory.md prints this
table::

    python benchmarks/memory_accounting.py [--markdown]
"""
from __future__ import annotations

import argparse

import torch

import qconf
from qconf._table import format_table

#: (parameter dtype, weights section, label of the update mode)
WEIGHTS = [(torch.float32, {}, "fp32"),
           (torch.bfloat16, {"rounding": "stochastic"}, "bf16 + SR"),
           (torch.bfloat16, {"compensation": "kahan"}, "bf16 + Kahan (bf16 buffer)"),
           (torch.bfloat16, {"rounding": "stochastic", "compensation": "kahan",
                             "compensation_codec": {"bits": 8}}, "bf16 + SR + Kahan (8-bit buffer)")]
CONFIGS = ["fp32", "8bit", "default"]
SHAPE = (4096, 4096)


def rows() -> list[list[str]]:
    """One row per (update mode, config): params, grads, states, P+G+S, and P+G+S with release."""
    out = []
    for dtype, weights, label in WEIGHTS:
        for config in CONFIGS:
            p = torch.nn.Parameter(torch.empty(SHAPE, dtype=dtype, device="meta"))
            per = {}
            for release in (False, True):
                opt = qconf.optim.AdamW([("w", p)], qconfig={"base": config, "weights": weights}, fused=False,
                                        gradient_release=release)
                per[release] = qconf.memory_report(opt)
            n = per[False].numel
            out.append([label, f"{config}.yml", f"{per[False].param_bytes / n:.2f}", f"{per[False].grad_bytes / n:.2f}",
                        f"{per[False].total_bytes / n:.3f}", f"{per[False].train_bytes_per_param:.2f}",
                        f"{(per[True].param_bytes + per[True].total_bytes) / n:.2f}"])
    return out


HEADERS = ["parameters", "states", "params B", "grads B", "states B", "P+G+S B/param",
           "with gradient release: P+S B/param (+ the largest gradient)"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="a Markdown table (docs/memory.md)")
    args = ap.parse_args()
    body = rows()
    if args.markdown:
        print("| " + " | ".join(HEADERS) + " |")
        print("|" + "---|" * len(HEADERS))
        for r in body:
            print("| " + " | ".join(r) + " |")
    else:
        print(format_table(HEADERS, body))


if __name__ == "__main__":
    main()
