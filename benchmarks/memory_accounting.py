"""Training bytes per parameter of each combination of parameter dtype, weight update mode and state
config, with and without gradient release, from ``qconf.memory_report`` (no training: the plan's
bytes, which equal the states' once they exist). One 4096x4096 parameter stands for a large model,
where the small tensors kept in fp32 (below ``min_numel``) do not count. docs/memory.md prints this
table::

    python benchmarks/memory_accounting.py [--markdown]

``--muon MODEL`` instead: the same accounting for ``qconf bench --memory --muon``'s rows on the
benchmark's GPT (``base``, ``base-32k``, ``small``; built on the meta device, nothing trained):
params + grads + states of qconf.optim.Muon (Muon on the hidden matrices, AdamW on the rest, its
default routing) per config, normal and with gradient release, and of torch.optim.Muon + AdamW
(fp32: 4 B of momentum per Muon parameter, 8 B of moments per AdamW one, as qconf's fp32.yml).
docs/memory.md prints the ``base`` table, the model a CPU cannot train with Muon in minutes::

    python benchmarks/memory_accounting.py --muon base [--markdown]
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


#: the --muon rows: (label, parameter dtype, qconfig), as qconf bench --memory --muon; torch's row holds
#: what qconf's fp32.yml holds (fp32 momentum per Muon parameter, two fp32 moments per AdamW one)
MUON_ROWS = [("torch Muon + AdamW fused fp32", torch.float32, "fp32"),
             ("qconf Muon muon_8bit.yml fp32", torch.float32, "muon_8bit"),
             ("qconf Muon default.yml bf16 SR", torch.bfloat16,
              {"base": "default", "weights": {"rounding": "stochastic"}})]
MUON_HEADERS = ["row", "gradient release", "params B", "grads B", "states B", "of which Muon part",
                "of which AdamW part", "P+G+S B/param"]


def muon_rows(model: str) -> list[list[str]]:
    """One row per --muon configuration (qconf rows normal and with gradient release) on the GPT ``model``."""
    from qconf.bench.memory import state_parts
    from qconf.bench.model import GPT, MODEL_PRESETS

    out = []
    for label, dtype, qconfig in MUON_ROWS:
        with torch.device("meta"):
            gpt = GPT(MODEL_PRESETS[model]).to(dtype)
        for release in (False,) if label.startswith("torch") else (False, True):
            opt = qconf.optim.Muon(gpt.named_parameters(), qconfig=qconfig, fused=False, gradient_release=release)
            report = qconf.memory_report(opt)
            n = report.numel
            parts = [f"{p['state_bytes'] / n:.3f} ({100 * p['numel'] / n:.1f}% of params)"
                     for p in state_parts(opt).values()]
            out.append([label, "yes" if release else "no", f"{report.param_bytes / n:.2f}",
                        f"{report.grad_bytes / n:.2f}", f"{report.bytes_per_param:.3f}", *parts,
                        f"{report.train_bytes_per_param:.2f}"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="a Markdown table (docs/memory.md)")
    ap.add_argument("--muon", metavar="MODEL", choices=("base", "base-32k", "small"),
                    help="the Muon rows of qconf bench --memory --muon on the benchmark's GPT MODEL instead")
    args = ap.parse_args()
    headers, body = (MUON_HEADERS, muon_rows(args.muon)) if args.muon else (HEADERS, rows())
    if args.markdown:
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for r in body:
            print("| " + " | ".join(r) + " |")
    else:
        print(format_table(headers, body))


if __name__ == "__main__":
    main()
