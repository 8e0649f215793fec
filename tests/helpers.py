"""Shared test fixtures: small models, a real learning task, state comparison."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def mlp(seed: int = 0, sizes=(64, 96, 96, 10), dtype=torch.float32) -> torch.nn.Sequential:
    """An MLP whose hidden weights exceed 4096 elements (quantized) and whose biases do not."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers).to(dtype)


def regression_batches(n_steps: int, seed: int = 0, in_dim: int = 64, out_dim: int = 10, batch: int = 32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(in_dim, out_dim, generator=g)
    for _ in range(n_steps):
        x = torch.randn(batch, in_dim, generator=g)
        yield x, torch.tanh(x @ w / 8)


def train_steps(model, opt, n_steps: int, seed: int = 0, dtype=torch.float32, on_step=None):
    """Run n_steps of MSE regression; returns the list of losses. Optimizers with ``maximize=True``
    get the negated loss, so every run descends the same landscape."""
    losses = []
    sign = -1.0 if opt.param_groups[0].get("maximize") else 1.0
    for i, (x, y) in enumerate(regression_batches(n_steps, seed)):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        (sign * loss).backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(i)
    return losses


#: the CPU kernels' instruction sets, each one containing the one before it
ISA_ORDER = ("scalar", "avx2", "avx512", "avx512vbmi")


def machine_isas() -> list[str]:
    """The ISAs this machine can run (``QCONF_CPU_ISA`` values), in ``ISA_ORDER``."""
    import qconf  # noqa: F401  (registers torch.ops.qconf)

    return list(ISA_ORDER[: ISA_ORDER.index(str(torch.ops.qconf.cpu_isa_best())) + 1])


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6) -> None:
    """max|actual - expected| <= rel * max|expected| (relative to the tensor's magnitude, so a
    1-ulp difference on a weight near zero does not count as a large relative error)."""
    err = (actual.detach().float() - expected.detach().float()).abs().max().item()
    ref = expected.detach().float().abs().max().item()
    assert err <= rel * ref, f"max abs diff {err:.3e} > {rel:g} * max|expected| {ref:.3e}"


def flat_state(opt) -> dict:
    """Every tensor of an optimizer's state_dict, keyed by path (for exact comparisons)."""
    out = {}

    def walk(prefix, v):
        if isinstance(v, torch.Tensor):
            out[prefix] = v.detach().clone()
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}", x)
        elif isinstance(v, (list, tuple)):
            for k, x in enumerate(v):
                walk(f"{prefix}[{k}]", x)
        else:
            out[prefix] = v

    walk("", opt.state_dict())
    return out


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def assert_same_run(a, b) -> None:
    """Two runs' (model or list of parameters, optimizer), on any devices: every parameter and
    every state_dict tensor equal, dtypes included."""
    (ma, oa), (mb, ob) = a, b
    pa = ma.parameters() if isinstance(ma, torch.nn.Module) else ma
    pb = mb.parameters() if isinstance(mb, torch.nn.Module) else mb
    for i, (p, q) in enumerate(zip(pa, pb, strict=True)):
        assert p.dtype == q.dtype and torch.equal(p.detach().cpu(), q.detach().cpu()), f"parameter {i}"

    def on_cpu(state):
        return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    assert_same_state(on_cpu(flat_state(oa)), on_cpu(flat_state(ob)))


def host_extension(name: str, source: str, functions: list[str], build_directory: Path):
    """Compile C++ ``source`` (which includes csrc/include headers) for the host, as the native
    extension is compiled (no fp contraction), exposing ``functions``; returns the module."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(name=name, cpp_sources=[source], functions=functions,
                       extra_include_paths=[str(ROOT / "csrc" / "include")],
                       extra_cflags=["-O1", "-std=c++17", "-ffp-contract=off"],
                       build_directory=str(build_directory), verbose=False)


def host_extension_job(module_file: str, builder: str):
    """A background job (conftest.py) that calls ``builder(workdir)`` of the test module at
    ``module_file`` in a child process. The builder compiles a host extension into that directory
    (host_extension); the module's fixture calls the same builder there once the job is done, and
    torch's JIT build finds everything compiled."""
    path = Path(module_file)
    code = (f"import sys; from pathlib import Path; sys.path.insert(0, {str(path.parent)!r}); import {path.stem}; "
            f"{path.stem}.{builder}(Path(sys.argv[1]))")
    return lambda workdir: [sys.executable, "-c", code, str(workdir)]


def prebuilt_extension(request, background_jobs, key: str, builder):
    """The module's host extension ``builder(workdir)`` from the finished background job ``key``."""
    returncode, out, err = background_jobs(request, key).result()
    assert returncode == 0, f"building the host extension failed ({returncode}):\n{(out + err)[-20000:]}"
    return builder(background_jobs(request, key).workdir)


def module_literal(path: Path, name: str):
    """The module-level literal ``name = ...`` of the Python file at ``path``, read without
    importing it (setup.py runs setup(); a GPU test module needs a GPU and its siblings)."""
    import ast

    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign)
                                                                      else None)
        if getattr(target, "id", None) == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} defines no {name}")
