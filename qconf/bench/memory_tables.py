"""The training-memory benchmark's printed report (``qconf bench --memory``): header (machine,
model, command), one table per device, and the footer saying what each column counts.

Every function takes the JSON-ready result of :func:`qconf.bench.memory.run_memory` and returns
text; nothing here measures.
"""
from __future__ import annotations

from typing import Any

from .._table import format_table
from .memory import FIELDS
from .model import MODEL_PRESETS, GPTConfig, uniform_loss
from .tables import format_machine

#: the table's columns: the row, B/param per field of :data:`~qconf.bench.memory.FIELDS`, the rest
HEADERS = ["row", "params", "grads", "states", "other", "p+g+s", "peak", "peak MiB", "ms/step", "final loss", "note"]


def describe_model(cfg: GPTConfig) -> str:
    """The model's parameter count and shape, on one line."""
    return f"GPT-style decoder-only transformer, {cfg.numel:,} params ({cfg.describe()})"


def format_memory_header(result: dict[str, Any]) -> str:
    """The lines above the tables: date, machine, versions, the model, the explicit command."""
    s = result["settings"]
    cfg = MODEL_PRESETS[s["model"]]
    if s.get("optimizer") == "muon":
        rule = ("Muon rows: Muon (torch.optim.Muon's defaults: momentum 0.95, Nesterov, 5 Newton-Schulz steps in "
                "bf16) on the hidden matrices, AdamW on the embeddings, head, norms and biases; AdamW rows: AdamW; "
                f"both lr {s['lr']:g}, weight decay {s['weight_decay']:g}")
    else:
        rule = f"AdamW lr {s['lr']:g}, weight decay {s['weight_decay']:g}"
    return "\n".join([f"qconf training-memory benchmark, {result['date']}",
                      *format_machine(result["machine"], ("torchao", "bitsandbytes", "flashoptim")),
                      f"model: {describe_model(cfg)}; random tokens (seed {s['seed']})",
                      f"training: {rule}; {s['warmup']} warm-up + {s['steps']} measured steps per row, each row in a "
                      "fresh child process",
                      f"command: {result['command']}"])


def _note(r: dict[str, Any], names: dict[str, str]) -> str:
    """A row's note: why it has no numbers, or (gradient release) how its loss compares with its
    normal counterpart's."""
    if r["status"] != "ok":
        return r["error"] if r["status"] == "error" else r["status"]
    if r["timing_losses_match"] is False:
        return "the timing run's losses differ from the memory run's"
    match = r.get("loss_matches_counterpart")
    if match is None:
        return ""
    other = names[r["counterpart"]]
    time = f"; ms/step x{r['step_time_ratio']:.3f} of it"
    if match:
        return f"final loss = {other} row's, bit for bit{time}"
    return f"final loss differs from {other} row's ({r['counterpart_final_loss']:.9g}){time}"


def _cells(r: dict[str, Any], names: dict[str, str]) -> list[Any]:
    per = r["b_per_param"]
    peak = r["bytes"]["peak"]
    return [r["name"], *(None if per[k] is None else f"{per[k]:.2f}" for k in FIELDS),
            None if peak is None else f"{peak / 2**20:,.0f}",
            None if r["step_ms"] is None else f"{r['step_ms']:,.0f}",
            None if r["final_loss"] is None else f"{r['final_loss']:.6f}", _note(r, names)]


def format_memory_device(result: dict[str, Any], device: str) -> str:
    """The table of ``device``'s rows (bytes per parameter, peak MiB, ms/step, final loss, note)."""
    rows = [r for r in result["rows"] if r["device"] == device]
    names = {r["key"]: r["name"] for r in rows}
    s = result["settings"]
    head = (f"== {device}: {s['numel']:,} params; peak memory of training in bytes per parameter "
            f"(params + grads + states + other = peak) ==")
    table = format_table(HEADERS, [_cells(r, names) for r in rows], align="lrrrrrrrrrl")
    return "\n".join([head, table, *format_state_parts(rows)])


def format_state_parts(rows: list[dict[str, Any]]) -> list[str]:
    """The lines under a Muon table: each Muon row's states split into its Muon part and its AdamW
    part, in bytes per parameter of the model (and per parameter of the part)."""
    out = []
    for r in rows:
        parts = r.get("state_parts")
        if r["status"] != "ok" or not parts:
            continue
        n = sum(p["numel"] for p in parts.values())
        cells = [f"{name} {p['state_bytes'] / n:.2f} ({p['state_bytes'] / max(p['numel'], 1):.3f} B over "
                 f"{100 * p['numel'] / n:.1f}% of the params)" for name, p in (("Muon", parts["muon"]),
                                                                              ("AdamW", parts["adamw"]))]
        out.append(f"states by part: {r['name']}: {' + '.join(cells)} = {r['b_per_param']['states']:.2f} B/param")
    return out


def format_memory_footer(result: dict[str, Any]) -> str:
    """What the columns count (the JSON's ``settings.attribution`` in short)."""
    s = result["settings"]
    cfg = MODEL_PRESETS[s["model"]]
    return "\n".join([
        "params = parameter bytes; grads = most gradient bytes alive at once (a post-accumulate-grad hook on every "
        "parameter; with gradient release about one parameter's); states = optimizer-state tensors after warm-up "
        "(qconf: codes + scales + fp32 states; step counters excluded).",
        "peak = on the CPU, VmHWM during the measured steps (reset after warm-up) minus the RSS before the model "
        "existed; on CUDA, max_memory_allocated during them minus memory_allocated before the model. "
        "other = peak - (params + grads + states): activations, workspace, allocator and runtime. With gradient "
        "release the peak moves from the optimizer step (every gradient alive) to the start of backward (every "
        "activation alive): its other is larger, its peak smaller.",
        f"ms/step = median of forward + backward + optimizer step + zero_grad over the measured steps (on the CPU in "
        f"a second child process with the default allocator). final loss = the "
        f"last measured step's; random tokens keep it near ln(vocab) = {uniform_loss(cfg):.4f}.",
    ])


def format_memory_report(result: dict[str, Any]) -> str:
    """The whole printed report: header, one table per device, footer."""
    parts = [format_memory_header(result), ""]
    for device in result["devices"]:
        parts += [format_memory_device(result, device), ""]
    return "\n".join(parts + [format_memory_footer(result)])
