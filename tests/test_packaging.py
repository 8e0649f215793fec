"""qconf as a user gets it: build the wheel, install it into a fresh venv, and run it from a directory
outside the checkout -- the optimizer with ``qconfig="default"``, ``qconf validate default``, ``qconf
compare default 8bit`` and ``qconf bench``, each with its smallest options.

The wheel is built with ``QCONF_NO_EXT=1`` (no C++ compile: the extension's build takes minutes on two
cores, and the configs and entry points do not depend on it); the installed package then runs on the
reference path, which also shows the real "no extension" message of ``backend="native"``.

The venv is fresh (``python -m venv --without-pip``) and gets torch, PyYAML, tqdm, scikit-learn and
matplotlib from the interpreter running the tests through a ``.pth`` file, the way
``--system-site-packages`` would from a system Python (the tests usually run inside a venv, whose
"system" Python has no torch). The venv's own site-packages comes first, so ``import qconf`` finds the
wheel, never the checkout or an editable install (asserted). Bounded: about a minute on two cores.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.packaging

#: what the build needs from the checkout (copied: a build in the checkout would reuse its build/ dir)
SOURCES = ["qconf", "configs", "csrc", "setup.py", "pyproject.toml", "README.md", "MANIFEST.in"]


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _clean_env() -> dict[str, str]:
    """The environment without anything that points Python at the checkout."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "QCONF_", "VIRTUAL_ENV"))}


def _dependency_dirs() -> list[str]:
    """site-packages directories holding the runtime dependencies, as the running interpreter sees them."""
    import matplotlib
    import sklearn
    import torch
    import tqdm
    import yaml

    dirs = {str(Path(m.__file__).resolve().parents[1]) for m in (torch, yaml, tqdm, sklearn, matplotlib)}
    return sorted(dirs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", "build")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    env = {**_clean_env(), "QCONF_NO_EXT": "1"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", str(dist),
          str(src)], cwd=src, env=env)
    (found,) = dist.glob("qconf-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    env = _clean_env()
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root, env=env)
    python = root / "bin" / "python"
    # pip of the test interpreter installs into the venv (pip >= 22.3: --python), before the dependencies
    # are linked in, so it sees a bare environment
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
         cwd=root, env=env)
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=root, env=env).stdout.strip()
    (Path(purelib) / "qconf_test_dependencies.pth").write_text("\n".join(_dependency_dirs()) + "\n")
    return root


@pytest.fixture()
def outside(tmp_path) -> Path:
    """A working directory outside the checkout (no configs/ beside it)."""
    assert REPO not in tmp_path.parents
    return tmp_path


def test_wheel_ships_configs_and_py_typed(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "qconf/py.typed" in names
    shipped = {f"qconf/configs/{p.name}" for p in (REPO / "configs").glob("*.yml")}
    assert shipped and shipped <= names
    assert {"qconf/configs/default.yml", "qconf/configs/8bit.yml", "qconf/configs/fp32.yml"} <= names
    assert not any(n.endswith(".so") for n in names)  # QCONF_NO_EXT=1


SCRIPT = """
import torch, qconf, qconf.optim
from qconf.config.builtin import builtin_dir
print("qconf", qconf.__file__)
print("configs", builtin_dir())
torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(128, 64))
opt = qconf.optim.AdamW([w], lr=1e-2, qconfig="default")
before = w.detach().clone()
w.grad = torch.randn_like(w)
opt.step()
print("changed", bool((w != before).any()), "source", opt.qconfig.source)
try:
    qconf.Codec(bits=4).encode(torch.randn(300), backend="native")
except RuntimeError as e:
    print("native:", e)
"""


def test_optimizer_with_builtin_name(venv, outside):
    out = _run([str(venv / "bin" / "python"), "-c", SCRIPT], cwd=outside, env=_clean_env()).stdout
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    site = Path(lines["qconf"]).parents[1]
    assert site.is_relative_to(venv), lines["qconf"]  # the wheel, not the checkout
    assert Path(lines["configs"]) == site / "qconf" / "configs"
    assert lines["changed"] == f"True source {site / 'qconf' / 'configs' / 'default.yml'}"
    assert lines["native:"].startswith("backend='native' needs the compiled extension qconf._C, which this "
                                       "installation of qconf does not have")


def test_cli_validate_and_list(venv, outside):
    qconf = str(venv / "bin" / "qconf")
    out = _run([qconf, "validate", "default", "8bit", "fp32"], cwd=outside, env=_clean_env()).stdout
    assert out.splitlines() == ["OK  default", "OK  8bit", "OK  fp32"]
    listing = _run([qconf, "validate", "--list"], cwd=outside, env=_clean_env()).stdout.splitlines()
    assert [line.split()[0] for line in listing[:-1]] == sorted(p.stem for p in (REPO / "configs").glob("*.yml"))


def test_cli_compare(venv, outside):
    proc = _run([str(venv / "bin" / "qconf"), "compare", "default", "8bit", "--task", "digits", "--steps", "2",
                 "--seeds", "1", "--eval-every", "1", "--no-qerr", "--no-progress", "--out", "results"],
                cwd=outside, env=_clean_env())
    assert "\nconfig " in proc.stdout and "\ndefault " in proc.stdout and "\n8bit " in proc.stdout
    assert (outside / "results" / "report.md").is_file()
    # a sweep in two worker processes (spawned from the installed package), extending the same study
    proc = _run([str(venv / "bin" / "qconf"), "compare", "default", "8bit", "--vary", "states.exp_avg.bits=2,3",
                 "--task", "digits", "--steps", "2", "--seeds", "1", "--eval-every", "1", "--no-qerr", "--no-progress",
                 "--jobs", "2", "--out", "results"], cwd=outside, env=_clean_env())
    assert "1 already in results; running 2 in 2 processes" in proc.stdout, proc.stdout
    table = [line.split()[:2] for line in proc.stdout.splitlines() if line.startswith(("config ", "default ", "8bit "))]
    assert table == [["config", "exp_avg.bits"], ["default", "2"], ["default", "3"], ["8bit", "2.248"]], proc.stdout
    assert (outside / "results" / "sweep.png").is_file()


def test_cli_bench(venv, outside):
    proc = _run([str(venv / "bin" / "qconf"), "bench", "--size", "tiny", "--rounds", "1", "--slow-rounds", "1",
                 "--warmup", "1", "--no-rss", "--quiet", "--contenders", "qconf-reference-*"],
                cwd=outside, env=_clean_env())
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("torch AdamW fused", "qconf reference"))]
    assert len(rows) == 2 and "qconf reference default.yml" in rows[1]
    assert "qconf ISA unavailable (qconf built without its extension" in proc.stdout
