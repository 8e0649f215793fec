"""Built-in config names (qconf.config.builtin): every place that takes a config takes "default", "8bit",
... (the shipped files' stems); paths keep precedence; unknown names list the built-ins. And the message of
``Codec.encode(backend="native")`` without the compiled extension."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import qconf
from qconf import Codec, QConfigError, _native, load_config
from qconf.bench import contenders
from qconf.config.builtin import builtin_dir, builtin_names, builtin_path, is_builtin_name
from qconf.study import compare

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.yml"))


def test_names_are_the_shipped_files():
    assert builtin_names() == [p.stem for p in SHIPPED]
    assert {"default", "8bit", "fp32", "2nd_moment_group_128"} <= set(builtin_names())
    assert builtin_dir() == REPO / "configs"  # a checkout: the repository's own files


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_load_by_name_equals_load_by_path(path):
    by_name = load_config(path.stem)
    assert by_name == load_config(path)
    assert Path(by_name.source) == builtin_path(path.stem) == path


def test_what_counts_as_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_builtin_name("default") and is_builtin_name("nosuch")
    for path_like in ("default.yml", "x.YAML", "./default", "sub/default", "", ".", "..", Path("default"), None, {}):
        assert not is_builtin_name(path_like), path_like
    (tmp_path / "default").write_text("min_numel: 7\n")  # an existing file wins over the built-in name
    assert not is_builtin_name("default")
    assert load_config("default").min_numel == 7


def test_base_may_name_a_builtin(tmp_path):
    (tmp_path / "mine.yml").write_text("base: 8bit\nmin_numel: 7\n")
    mine = load_config(tmp_path / "mine.yml")
    eight = load_config("8bit")
    assert mine.min_numel == 7 and mine.states == eight.states
    (tmp_path / "8bit").write_text("min_numel: 9\n")  # a file beside the config wins over the name
    (tmp_path / "mine.yml").write_text("base: 8bit\n")
    assert load_config(tmp_path / "mine.yml").min_numel == 9
    (tmp_path / "bad.yml").write_text("base: nosuch\n")
    with pytest.raises(QConfigError, match="base file .*nosuch.* does not exist"):
        load_config(tmp_path / "bad.yml")


def test_unknown_name_lists_the_builtins():
    with pytest.raises(QConfigError) as info:
        load_config("defualt")
    (problem,) = info.value.problems
    assert problem.file == "defualt"
    assert "'defualt' is neither a config file nor a built-in config name" in problem.message
    assert problem.allowed.startswith("a built-in name (" + ", ".join(builtin_names()) + ")")
    assert problem.suggestion == "default"
    with pytest.raises(QConfigError, match="nor a built-in config name"):
        qconf.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], qconfig="defualt")


def test_optimizer_takes_a_name():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(80, 80)), torch.nn.Parameter(torch.randn(80, 80))
    b.data.copy_(a.data)
    by_name = qconf.optim.AdamW([a], lr=1e-2, qconfig="default", fused=False)
    by_path = qconf.optim.AdamW([b], lr=1e-2, qconfig=str(REPO / "configs" / "default.yml"), fused=False)
    assert by_name.qconfig == by_path.qconfig
    for _ in range(2):
        for p, opt in ((a, by_name), (b, by_path)):
            p.grad = torch.ones_like(p) * p.detach()
            opt.step()
    assert torch.equal(a, b)
    assert by_name.qconfig.states["exp_avg_sq"].scale == "rank1"  # the paper's "4-bit AdamW", not the defaults


def test_compare_takes_names():
    result = compare(["fp32", "default"], task="test_study_tasks:tiny_task", steps=2, seeds=1, out=False,
                     progress=False, measure_error=False)
    assert [c.label for c in result.rows] == ["fp32", "default"]
    assert [c.source for c in result.rows] == ["fp32", "default"]
    assert result.settings["command"].startswith("qconf compare fp32 default ")


def test_bench_uses_the_builtin_configs_by_default():
    keys = {c.key for c in contenders()}
    assert {"qconf-fused-default-fp32", "qconf-fused-group128-fp32", "qconf-fused-8bit-fp32"} <= keys


def test_native_backend_without_extension_says_what_to_do(monkeypatch):
    monkeypatch.setattr(_native, "_C", None)  # as on an install built with QCONF_NO_EXT=1
    codec = Codec(bits=4)
    x = torch.randn(300)
    for call in (lambda: codec.encode(x, backend="native"), lambda: codec.decode(codec.encode(x), backend="native")):
        with pytest.raises(RuntimeError) as info:
            call()
        message = str(info.value)
        assert message.startswith("backend='native' needs the compiled extension qconf._C")
        assert "use backend='reference'" in message and "pip install --no-build-isolation" in message
