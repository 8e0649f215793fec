"""The benchmark's printed report: header (machine, command), one table per size with its
footnotes, the per-tensor overhead lines (``many`` vs ``one``) and the footer.

Every function takes the JSON-ready result of :func:`qconf.bench.run` (or one size of it) and
returns text; nothing here measures.
"""
from __future__ import annotations

from typing import Any

from .._table import format_table
from .measure import SLOW_FACTOR
from .roster import BASELINE, BASELINE_TEXT


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _fmt_ns(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _size_footnotes(res: dict[str, Any], slow: bool, methods: set[str]) -> list[str]:
    """The lines under a size's table: costs over related rows, CPU noise, slow rows, RSS method."""
    out = []
    labels = {r["key"]: f"{r['label']} ({r['dtype']})" for r in res["rows"]}
    for r in res["rows"]:
        if r.get("ratio_vs_relative") is not None:
            out.append(f"cost: {labels[r['key']]}: {r['ratio_vs_relative']:.2f}x the step time of "
                       f"{labels[r['relative_to']]} (median of per-round ratios).")
    other = res.get("other_cpu")
    if other is not None:
        out.append(f"noise: other processes used {other['other_pct']:.0f}% of the machine's CPU time during the "
                   f"timed rounds (VM steal {other['steal_pct']:.0f}%).")
    if slow:
        out.append(f"* slow contender (warm-up step > {SLOW_FACTOR:g}x the baseline's): timed in {res['slow_rounds']} "
                   f"of the {res['rounds']} rounds, spread evenly; its ratios use the baseline time of those rounds.")
    if "sampling" in methods:
        out.append("peak extra RSS: /proc/self/clear_refs was not writable; sampled VmRSS every 0.5 ms instead "
                   "(can miss short peaks).")
    return out


#: the device table's formula lines (printed under every --device cuda table)
DEVICE_FORMULA = (
    "GB/s = bytes/step / median step time; bytes/step = params x (2P + G + 2S): read p, g and the states, write p "
    "and the states once (P, G = param and grad bytes: 4 fp32, 2 bf16; S = state B/param), the least a step "
    "moves (28 B/param for torch fused AdamW fp32).",
    "% copy BW = median over rounds of (bytes/step / step time) / (copy bytes / copy time in the same round).")


def _baseline(res: dict[str, Any]) -> tuple[str, str, str]:
    """``(key, ratio column word, title text)`` of the size's baseline row (torch fused AdamW, or
    torch.optim.Muon for the Muon roster)."""
    key = res.get("baseline", BASELINE)
    word, text = BASELINE_TEXT.get(key, (key, key))
    return key, word, text


def _title(res: dict[str, Any]) -> str:
    """The line above a size's table."""
    _, _, text = _baseline(res)
    return (f"== {res['size']}: {res['shapes']} = {res['numel']:,} params; {res['rounds']} rounds; "
            f"ratios = median (min) over rounds of step time / {text} step time in the same round ==")


def _fmt_gbps(x: float | None) -> str:
    return "" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.2f}"


def _mib(x: int | None) -> str:
    return "" if x is None else f"{x / 2**20:,.0f}"


def _device_row(r: dict[str, Any], rounds: int, numel: int, baseline: str = BASELINE) -> list[str]:
    """One row of the device table."""
    ok = r["status"] == "ok"
    ms = r.get("ns_per_param")
    frac = r.get("copy_fraction")
    timed = r.get("rounds_timed")
    return [r["label"] + ("  (baseline)" if r["key"] == baseline else ""), r["dtype"],
            "" if ms is None else f"{ms * numel / 1e6:.3f}",
            _fmt(r.get("ratio_median"), ".2f"), _fmt(r.get("ratio_min"), ".2f"), _fmt_gbps(r.get("gb_per_s")),
            "" if frac is None else f"{100 * frac:.0f}%",
            f"{timed}{'*' if timed is not None and timed < rounds else ''}" if ok else "",
            _fmt(r.get("state_bytes_per_param"), ".3f"), _mib(r.get("peak_mem_bytes")),
            _mib(r.get("step_extra_bytes")), r["error"] or ""]


def format_device_size(res: dict[str, Any]) -> str:
    """One size's table on a device (``--device cuda``): ms/step, ratios, GB/s, % of the device
    copy's bandwidth, state bytes, peak device memory; the copy line and the formulas under it."""
    base, word, _ = _baseline(res)
    head = _title(res)
    headers = ["contender", "params", "ms/step", f"x {word} med", f"x {word} min", "GB/s", "% copy BW", "rounds",
               "state B/param", "peak MiB", "step extra MiB", "note"]
    rows = res["rows"]
    body = [_device_row(r, res["rounds"], res["numel"], base) for r in rows]
    slow = any(r["status"] == "ok" and (r.get("rounds_timed") or res["rounds"]) < res["rounds"] for r in rows)
    out = [head, format_table(headers, body, align="llrrrrrrrrrl")]
    copy = res.get("copy")
    if copy is not None:
        out.append(f"device copy: {_fmt_gbps(copy['gb_per_s'])} GB/s (dst.copy_(src) of {copy['bytes'] // 2:,} bytes: "
                   f"{copy['bytes']:,} bytes read + written = 28 B/param; median {copy['median_ns'] / 1e6:.3f} ms, "
                   "timed in the same rounds)")
    else:
        out.append("device copy: not timed")
    out += list(DEVICE_FORMULA)
    out.append("peak MiB = peak allocated during build + warm-up above what was allocated before (parameters, "
               "states, step temporaries; the shared gradients not counted); step extra MiB = the last warm-up "
               "step's peak above what was allocated before it.")
    if res.get("grads_modified"):
        out.append("warning: a contender wrote to the shared gradients; rows timed after it stepped on other gradients.")
    return "\n".join(out + _size_footnotes(res, slow, set()))


def format_size(res: dict[str, Any]) -> str:
    """One size's table plus footnotes (a device run's: :func:`format_device_size`)."""
    if "copy" in res:
        return format_device_size(res)
    base, word, _ = _baseline(res)
    head = _title(res)
    headers = ["contender", "params", "ns/param", f"x {word} med", f"x {word} min", "rounds", "state B/param",
               "peak extra RSS", "note"]
    body = []
    slow = False
    methods = set()
    for r in res["rows"]:
        rss = r.get("rss") or {}
        if "pct_of_param_bytes" in rss:
            methods.add(rss["method"])
        note = r["error"] or ""
        if r["status"] == "ok" and rss.get("error"):
            note = f"RSS: {rss['error']}"
        rounds = r.get("rounds_timed")
        mark = ""
        if r["status"] == "ok" and rounds is not None and rounds < res["rounds"]:
            mark, slow = "*", True
        body.append([r["label"] + ("  (baseline)" if r["key"] == base else ""), r["dtype"],
                     _fmt_ns(r.get("ns_per_param")), _fmt(r.get("ratio_median"), ".2f"), _fmt(r.get("ratio_min"), ".2f"),
                     f"{rounds}{mark}" if r["status"] == "ok" else "", _fmt(r.get("state_bytes_per_param"), ".3f"),
                     f"{rss['pct_of_param_bytes']:.1f}%" if "pct_of_param_bytes" in rss else "", note])
    out = [head, format_table(headers, body, align="llrrrrrrl")]
    if base != BASELINE:  # (the Muon roster: steps of seconds, read better per step than per parameter)
        steps = [f"{r['label']} {r['ns_per_param'] * res['numel'] / 1e6:,.0f} ms" for r in res["rows"]
                 if r.get("ns_per_param") is not None]
        if steps:
            out.append("median step: " + "; ".join(steps) + ".")
    return "\n".join(out + _size_footnotes(res, slow, methods))


def format_machine(m: dict[str, Any], packages: tuple[str, ...] = ("torchao", "bitsandbytes")) -> list[str]:
    """The ``machine:`` line (CPU, qconf ISA, threads, versions of torch, qconf and ``packages``)
    and, when ``m["gpu"]`` is set, the ``device:`` line without its kernel note."""
    ext = ", ".join(f"{k} {m.get(k) or 'not installed'}" for k in packages)
    lines = [f"machine: {m['cpu']} ({m['cpus']} CPUs), qconf ISA {m['qconf_isa']} "
             f"(torch capability {m['torch_cpu_capability']}), threads {m['threads']}; torch {m['torch']}, "
             f"qconf {m['qconf']}, {ext}, Python {m['python']}"]
    gpu = m.get("gpu")
    if gpu is not None:
        lines.append(f"device: {gpu['name']} ({gpu['capability']}, {gpu['memory_gib']:.1f} GiB); torch {m['torch']}, "
                     f"CUDA {gpu['cuda']}; qconf CUDA kernels {'built' if gpu['qconf_cuda_kernels'] else 'NOT built'}")
    return lines


def format_header(result: dict[str, Any]) -> str:
    """The lines above the tables: date, machine, versions, the explicit command."""
    lines = [f"qconf optimizer-step benchmark, {result['date']}"] + format_machine(result["machine"])
    if len(lines) > 2:
        lines[2] += "; qconf rows run QCONF_CUDA_KERNELS=generic, '(specialized)' rows =specialized"
    lines.append(f"command: {result['command']}")
    if result["settings"]["min_numel"] is not None:
        lines.append(f"qconf configs with min_numel overridden to {result['settings']['min_numel']}")
    return "\n".join(lines)


def format_footer(result: dict[str, Any]) -> str:
    """The closing paragraph: what ns/param, state B/param and (when measured) peak extra RSS mean."""
    if result.get("device", "cpu") != "cpu":
        return ("ms/step = median over rounds of one step's time, torch.cuda.synchronize() before and after it. "
                "state B/param = optimizer-state tensors after warm-up (step counters excluded). Gradients are "
                "shared by the rows of one dtype.")
    text = ("ns/param = median step time / params. state B/param = optimizer-state tensors after warm-up "
            "(step counters excluded).")
    if result["settings"]["rss"]:
        text += (f" peak extra RSS = VmHWM during {result['settings']['rss_steps']} steps minus RSS before them, "
                 "% of the parameter bytes (fresh subprocess per contender).")
    lines = [text]
    return "\n".join(lines)


def format_many_vs_one(many: dict[str, Any], one: dict[str, Any]) -> str:
    """Per-tensor overhead: ns/param on 1000 tensors of 4096 over ns/param on one 1000x4096 tensor."""
    lines = ["== per-tensor overhead: ns/param on `many` (1000 x 4096) / ns/param on `one` (1 x 1000x4096) =="]
    by_key = {r["key"]: r for r in one["rows"]}
    for r in many["rows"]:
        o = by_key.get(r["key"])
        if r.get("ns_per_param") and o and o.get("ns_per_param"):
            lines.append(f"{r['label']} ({r['dtype']}): {r['ns_per_param'] / o['ns_per_param']:.2f}x")
    return "\n".join(lines)


def format_report(result: dict[str, Any]) -> str:
    """The whole printed report: header, one table per size, footer."""
    parts = [format_header(result), ""]
    for res in result["sizes"].values():
        parts += [format_size(res), ""]
    if "many" in result["sizes"] and "one" in result["sizes"]:
        parts += [format_many_vs_one(result["sizes"]["many"], result["sizes"]["one"]), ""]
    return "\n".join(parts + [format_footer(result)])
