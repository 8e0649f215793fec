"""The specialized CUDA kernels measured without a GPU (qconf/bench/sass.py, qconf/bench/cuda_static.py).

The parser is checked on hand-written SASS; then real specs are compiled for sm_90 with the pip
NVRTC and read with the pip cuobjdump (requirements-dev.txt), and must keep the targets of
docs/kernels.md: at most 64 registers, no stack or spills, at most 100 hot SASS instructions per
element, no local-memory, barrier or atomic instruction in the main loop. The specs are the most
common one (group-128 4-bit, fp32 parameters) and the two nearest the instruction limit (8bit.yml's
1-D spec with bf16 parameters; bf16 parameters with stochastic rounding, bitnet_4bit_bf16.yml), so
a change that costs instructions shows here; and one spec of each of Muon's two calls.
"""
from __future__ import annotations

import pytest

from qconf import _native
from qconf.bench import sass
from qconf.bench.cuda_static import TARGETS, analyze_spec, barriers_allowed, find_tools, target_failures

LOOP = """
        Function : qconf_spec_apply
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0030*/                   FFMA R3, R2, R2, RZ ;
        /*0040*/              @!P0 BRA 0x80 ;
        /*0050*/                   MOV R12, 0x80 ;
        /*0060*/                   CALL.REL.NOINC 0x200 ;
        /*0070*/                   NOP ;
        /*0080*/                   BSYNC B0 ;
        /*0090*/               @P0 BRA P1, 0xc0 ;
        /*00a0*/                   CALL.REL.NOINC 0x300 ;
        /*00b0*/                   MOV R6, R7 ;
        /*00c0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00d0*/                   FADD R2, R2, R3 ;
        /*00e0*/               @P2 BRA 0xf0 ;
        /*00f0*/                   ATOMS.ADD R5, [R6], R7 ;
        /*0100*/               @P3 BRA 0x20 ;
        /*0110*/                   EXIT ;
        /*0120*/                   BRA 0x120 ;
        Function : other
        /*0000*/                   EXIT ;
"""


def test_the_main_loop_and_its_cold_blocks_are_counted_as_documented():
    functions = sass.parse_sass(LOOP)
    assert set(functions) == {"qconf_spec_apply", "other"}
    instrs = functions["qconf_spec_apply"]
    body = sass.main_loop(instrs)
    assert (body[0].addr, body[-1].addr) == (0x20, 0x100)  # the loop, not the trailing self-branch
    count = sass.count_main_loop(instrs, elements=2)
    # cold: 0x50-0x70 (guarded branch over a CALL) and 0xa0-0xb0 ("@P0 BRA P1, target" form);
    # the branch over 0xf0 holds no call, so it stays hot
    assert (count.static, count.hot) == (15, 10)
    assert count.hot_per_element == 5.0 and count.static_per_element == 7.5
    assert count.forbidden == {"local": 0, "barrier": 1, "atomic": 1}
    assert sass.Instr(0, "@!P0 FFMA.FTZ R1, R2, R3, R4").opcode == "FFMA"


def test_ptxas_report_is_read_per_entry():
    log = """ptxas info    : Compiling entry function 'qconf_spec_apply' for 'sm_90'
ptxas info    : Function properties for qconf_spec_apply
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 3808 bytes cmem[0]
ptxas info    : Compiling entry function 'qconf_spec_reduce' for 'sm_90'
ptxas info    : Function properties for qconf_spec_reduce
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, 3808 bytes cmem[0]
"""
    got = sass.parse_ptxas(log)
    assert got["qconf_spec_apply"] == {"registers": 64, "stack": 8, "spill_stores": 4, "spill_loads": 12}
    assert got["qconf_spec_reduce"]["registers"] == 40


def test_barriers_are_allowed_only_where_a_group_spans_warps():
    assert barriers_allowed("adam.wd-f32.f32-plain-q4.g512.search-q4.g128.grid-none") == 1
    assert barriers_allowed("adam.wd-f32.f32-plain-q4.g256.search-q4.r1.grid-none") == 0


@pytest.fixture(scope="module")
def tools():
    if not _native.native_available():  # pragma: no cover - the CI build always has the extension
        pytest.skip(f"extension unavailable: {_native.native_error()}")
    try:
        return find_tools()
    except FileNotFoundError as e:  # pragma: no cover - requirements-dev.txt installs both
        pytest.skip(str(e))


@pytest.mark.parametrize("spec", ["adam.wd-f32.f32-plain-q4.g128.search-q4.g128.grid-none",
                                  "adam.wd-bf16.bf16-plain-q8.g256.lines_s-q8.g256.lines_u-none",
                                  "adam.wd-bf16.bf16-sr-q4.g128.search-q4.g128.grid-none"])
def test_group_scaled_specs_keep_the_targets(spec, tools, tmp_path):
    (k,) = analyze_spec(spec, tools, 90, str(tmp_path))
    assert k.kernel == "apply"
    assert k.registers <= TARGETS["registers"] and k.stack == 0 and k.spills == 0, k
    assert k.loop.hot_per_element <= TARGETS["hot_per_element"], k.loop
    assert k.loop.hot_per_element >= 30  # (a real loop was found: AdamW alone is about 30 per element)
    assert not any(k.loop.forbidden.values()), k.loop.forbidden
    row = {"spec": spec, "group_scaled": True, "kernels": [k]}
    assert target_failures([row]) == []


@pytest.mark.parametrize("spec", ["muon_momentum.pn-bf16.f32-plain-q8.g256.lines_s-none-none",
                                  "muon_update.w-bf16.bf16-sr-none-none-none"])
def test_muon_specs_compile_for_the_gpu_within_the_targets(spec, tools, tmp_path):
    """Muon's two calls -- the momentum into the bf16 scratch (configs/muon_8bit.yml's 8-bit linear
    codec), the update of a bf16 parameter with stochastic rounding -- compile with NVRTC for sm_90
    as the driver compiles them at first use (no Muon spec is ahead of time; tests/test_spec_host.py
    runs their per-thread code on the host), within the group-scaled specs' targets."""
    (k,) = analyze_spec(spec, tools, 90, str(tmp_path))
    assert k.kernel == "apply"
    assert k.registers <= TARGETS["registers"] and k.stack == 0 and k.spills == 0, k
    assert 5 <= k.loop.hot_per_element <= TARGETS["hot_per_element"], k.loop  # (5: a real loop was found)
    assert not any(k.loop.forbidden.values()), k.loop.forbidden
    assert target_failures([{"spec": spec, "group_scaled": True, "kernels": [k]}]) == []


def test_rank1_specs_report_both_passes(tools, tmp_path):
    kernels = analyze_spec("adam.wd-f32.f32-plain-q4.g128.search-q4.r1.grid-none", tools, 90, str(tmp_path))
    assert [k.kernel for k in kernels] == ["apply", "reduce"]
    apply, reduce = kernels
    assert all(k.stack == 0 and k.spills == 0 and k.loop.hot_per_element > 0 for k in kernels)
    assert not any(apply.loop.forbidden.values())
    # the reduce pass: a row's maximum leaves each warp by one atomicMax per iteration (256
    # elements), the columns' after the loop; nothing per element
    assert reduce.loop.forbidden == {"local": 0, "barrier": 0, "atomic": 1}


def test_the_cli_prints_the_table_and_the_verdict(tools, tmp_path, capsys):
    from qconf.cli import main

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "fp32.yml").write_text("version: 1\nstates:\n  exp_avg: {enable: false}\n"
                                             "  exp_avg_sq: {enable: false}\n")
    rc = main(["bench", "--cuda-static", "--configs", str(tmp_path / "c"), "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "adam.wd-f32.f32-plain-fp32-fp32-none" in out and "adam.wd-bf16.bf16-plain-fp32-fp32-none" in out
    assert out.rstrip().endswith("all met")
    assert (tmp_path / "out.json").read_text().startswith("[")
