"""The fused optimizer step: builds the kernel's arguments from a param group and calls it.

Per param group the per-parameter tensors (params, step counters, state codes/scales/values,
codec tables and a metadata table) are collected once into a C++ ``StepPlan``; an eager step then
passes only the gradients and the hyperparameters, so the cost per parameter stays small even with
thousands of small tensors. Under ``torch.compile`` the functional op ``qconf::fused_step`` (with a
fake implementation) is called instead, with every tensor as an argument.

The plan is rebuilt when the optimizer's layout changes (states created or converted,
``load_state_dict``, ``override_quantize_enable``, ``add_param_group``) or when the set of
parameters that have gradients changes.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ..codec import Codec, QTensor
from .octave_lines import octave_lines

if TYPE_CHECKING:  # pragma: no cover
    from ..optim.base import QOptimizer

# layout constants shared with csrc/include/qconf/step_driver.h
COL_INDEX, COL_FIRST, COL_FACTORED, COL_NDIM, COL_SHAPE, COL_STATE = 0, 1, 2, 3, 4, 12
STATE_COLS = 9
COL_WEIGHTS = COL_STATE + 2 * STATE_COLS  # bit 0: stochastic rounding, bit 1: Kahan
COL_COMP = COL_WEIGHTS + 1                # the Kahan buffer, described like a state
META_COLS = COL_COMP + STATE_COLS
STATE_SLOTS = 8
TABLE_ROWS, TABLE_SIZE = 12, 256
KIND_NONE, KIND_FP32, KIND_QUANT, KIND_PARAM_DTYPE = 0, 1, 2, 3
SCALE_BLOCK, SCALE_DIM1, SCALE_RANK1 = 0, 1, 2
RULES = {"adam": 0, "adamw": 0, "sgd": 1, "lion": 2}
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EMPTY = torch.empty(0)


def midpoint_grid(mids: torch.Tensor) -> tuple[float, float]:
    """(L, c) when the float32 midpoints are exactly ``(k + c) / L`` for k = 0, 1, ...: L a power
    of two (at most 2**16) and c - 1/2 a non-negative integer, e.g. power-1 maps ((k + 1.5) / 16
    at 4 bits). Then the nearest code is ``clamp(ceil(n * L - c), 0, levels - 1)``, exact in
    float32 (the kernel's proof is at FastQuantizer in csrc/include/qconf/step_cpu.h). (0, 0)
    otherwise."""
    m = mids.double()
    if m.numel() < 2:
        return 0.0, 0.0
    step = float(m[1] - m[0])
    if step <= 0:
        return 0.0, 0.0
    L = 1.0 / step
    mant, _ = math.frexp(L)
    c = float(m[0]) * L
    o = c - 0.5
    if mant != 0.5 or not 1.0 <= L <= 2.0 ** 16 or o < 0 or o != math.floor(o):
        return 0.0, 0.0
    grid = (torch.arange(m.numel(), dtype=torch.float64) + c) / L
    return (L, c) if torch.equal(grid, m) else (0.0, 0.0)


def codec_table(codec: Codec) -> torch.Tensor:
    """The kernel's lookup tables of a codec, float32 [12, 256]:

    0. qmap (padded with its last value); 1. midpoints then +inf; 2. qmap then +inf;
    3. coarse16: midpoints[16k+15] (16), qmap+inf[16k+15] (16)   -- first 4 search levels;
       then at [32], [33] the grid (L, c) of the midpoints, or (0, 0): see ``midpoint_grid``;
       then from [64] the 16-entry search tables shifted by 3 and by 1 (``t[min(j + s, 15)]``),
       16 each: midpoints[:16], qmap+inf[:16], coarse16 midpoints, coarse16 qmap+inf
    4. coarse32: midpoints[8k+7] (32), qmap+inf[8k+7] (32)        -- 8-bit permute search;
       then from [64] both shifted by 7, 3 and 1 (``t[min(j + s, 31)]``), 32 each
    5. columns of the midpoints: [j*32 + k] = midpoints[8k+j], j < 7
    6. columns of qmap+inf:      [j*32 + k] = qsearch[8k+j], j < 7
    7. 8-bit maps: the octave lines of the midpoints (``ops.octave_lines``), or zeros (search)
    8, 9. rows 0 and 1 as 16-bit planes: the low halves of the 256 entries, then the high halves
    10, 11. rows 0 and 1 as byte planes: byte 0 of the 256 entries, then byte 1, 2, 3
       (raw bits in float32 storage, for the kernels' byte/word permutes: ``Isa::lookup256n``)
    """
    qmap = codec.qmap
    levels = qmap.numel()
    inf = torch.full((TABLE_SIZE,), math.inf)
    t = torch.zeros(TABLE_ROWS, TABLE_SIZE)
    t[0, :levels] = qmap
    t[0, levels:] = qmap[-1]
    mids = inf.clone()
    mids[: levels - 1] = codec.midpoints
    qsearch = inf.clone()
    qsearch[:levels] = qmap
    t[1], t[2] = mids, qsearch
    coarse = torch.arange(15, TABLE_SIZE, 16)
    t[3, :16] = mids[coarse]
    t[3, 16:32] = qsearch[coarse]
    t[3, 32], t[3, 33] = midpoint_grid(codec.midpoints)
    coarse32 = torch.arange(7, TABLE_SIZE, 8)
    t[4, :32] = mids[coarse32]
    t[4, 32:64] = qsearch[coarse32]
    # shifted copies: a binary-search probe table[c + s - 1] becomes a plain permute at c
    def shifted(table: torch.Tensor, steps: tuple[int, ...]) -> torch.Tensor:
        n = table.numel()
        return torch.cat([table[(torch.arange(n) + s).clamp(max=n - 1)] for s in steps])
    t[3, 64:192] = torch.cat([shifted(x, (3, 1)) for x in (mids[:16], qsearch[:16], t[3, :16], t[3, 16:32])])
    t[4, 64:256] = torch.cat([shifted(x, (7, 3, 1)) for x in (t[4, :32], t[4, 32:64])])
    cols = torch.arange(32) * 8
    for j in range(7):
        t[5, j * 32:(j + 1) * 32] = mids[cols + j]
        t[6, j * 32:(j + 1) * 32] = qsearch[cols + j]
    lines = octave_lines(codec.midpoints) if codec.bits == 8 else None
    if lines is not None:
        t[7] = lines
    for row, values in ((8, t[0]), (9, t[1])):
        b = values.contiguous().view(torch.uint8).reshape(TABLE_SIZE, 4)  # little-endian bytes
        t[row] = torch.cat([b[:, 0:2].reshape(-1), b[:, 2:4].reshape(-1)]).view(torch.float32)
        t[row + 2] = b.t().contiguous().reshape(-1).view(torch.float32)
    return t


def scale_layout(codec: Codec, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(scale kind, block, d1, inner) of ``codec`` on ``shape`` after the rank fallbacks."""
    numel = math.prod(shape)
    eff = codec.effective_scale(shape)
    if eff == "tensor":
        return SCALE_BLOCK, max(numel, 1), 0, 0
    if eff == "dim0":
        return SCALE_BLOCK, max(numel // shape[0], 1), 0, 0
    if eff == "group":
        return SCALE_BLOCK, codec.group_size, 0, 0
    if eff == "dim1":
        return SCALE_DIM1, 0, shape[1], max(math.prod(shape[2:]), 1)
    return SCALE_RANK1, 0, 0, 0


def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("qconf::fused_step", "CUDA")


def unfusable_reason(p: torch.Tensor) -> str | None:
    """Why parameter ``p`` cannot take the fused step (None if it can)."""
    if p.dtype not in FUSED_DTYPES:
        return f"dtype {p.dtype} (fused kernels take float32, bfloat16, float16)"
    if p.device.type == "cuda" and not _has_cuda_kernels():
        return f"device {p.device} (this build of qconf has no CUDA kernels; rebuild with nvcc and a CUDA torch)"
    if p.device.type not in ("cpu", "cuda"):
        return f"device {p.device} (fused kernels run on CPU and CUDA)"
    if p.dim() > 8:
        return f"{p.dim()} dimensions (at most 8)"
    if not p.is_contiguous():
        return "a non-contiguous parameter"
    return None


class _GroupPlan:
    """Arguments of the kernel for one param group, and the C++ StepPlan holding them."""

    def __init__(self, opt: "QOptimizer", group: dict[str, Any], params: list[torch.Tensor],
                 new: dict[int, frozenset[str]]):
        index = opt._param_index()
        meta = torch.zeros(len(params), META_COLS, dtype=torch.int64)
        tables: dict[Codec, int] = {}
        states: list[torch.Tensor] = []
        steps = []
        self.one_shot = False
        for row, p in enumerate(params):
            i = index[id(p)]
            st = opt.state[p]
            steps.append(st["step"])
            specs = opt._state_specs(group, p)
            m = meta[row]
            m[COL_INDEX] = i
            m[COL_NDIM] = p.dim()
            m[COL_SHAPE:COL_SHAPE + p.dim()] = torch.tensor(p.shape, dtype=torch.int64)
            slots: list[torch.Tensor] = [_EMPTY] * STATE_SLOTS
            for spec in specs:
                if spec.key in ("exp_avg_sq_row", "exp_avg_sq_col"):
                    m[COL_FACTORED] = 1
                    slots[4 if spec.key.endswith("row") else 5] = st[spec.key]
                    continue
                k = 0 if spec is specs[0] else 1
                self._describe_state(m, COL_STATE + k * STATE_COLS, st[spec.key], p, tables, slots, 2 * k,
                                     KIND_FP32)
            weights = opt.plan(i).weights
            if p.dtype != torch.float32:  # fp32 parameters take the fp32 result as is
                m[COL_WEIGHTS] = int(weights.rounding == "stochastic") | (int("kahan_comp" in st) << 1)
                if "kahan_comp" in st:
                    self._describe_state(m, COL_COMP, st["kahan_comp"], p, tables, slots, 6, KIND_PARAM_DTYPE)
            if spec_first(opt, new.get(i, frozenset())):
                m[COL_FIRST] = 1
                self.one_shot = True  # the first-step flag holds for this step only
            states.extend(slots)
        table_list = sorted(tables, key=tables.get)
        self.tables = (torch.stack([codec_table(c) for c in table_list]) if table_list
                       else torch.zeros(1, TABLE_ROWS, TABLE_SIZE))
        self.params, self.steps, self.states, self.meta = params, steps, states, meta
        self.rule = RULES[opt.rule_name]
        self.cpp = torch.classes.qconf.StepPlan(self.rule, params, steps, states, meta, self.tables)

    @staticmethod
    def _describe_state(m: torch.Tensor, base: int, value: Any, p: torch.Tensor, tables: dict[Codec, int],
                        slots: list[torch.Tensor], slot: int, dense_kind: int) -> None:
        """Meta columns ``m[base:base+STATE_COLS]`` and tensor slots of one state: a QTensor
        (kind, table, bits, levels, scale kind, block, d1, inner, stochastic) or a dense tensor."""
        if isinstance(value, QTensor):
            c = value.codec
            table = tables.setdefault(c, len(tables))
            kind, block, d1, inner = scale_layout(c, tuple(p.shape))
            m[base:base + STATE_COLS] = torch.tensor(
                [KIND_QUANT, table, c.bits, c.qmap.numel(), kind, block, d1, inner,
                 int(c.rounding == "stochastic")], dtype=torch.int64)
            slots[slot], slots[slot + 1] = value.codes, value.scales
        else:
            m[base] = dense_kind
            slots[slot] = value

    def run(self, grads: list[torch.Tensor], hyper: list[float], seed: int) -> None:
        if torch.compiler.is_compiling():
            torch.ops.qconf.fused_step(self.rule, self.params, grads, self.steps, self.states, self.meta,
                                       self.tables, hyper, seed)
        else:
            self.cpp.run(hyper, seed)  # reads each parameter's .grad in C++


def spec_first(opt: "QOptimizer", new: frozenset[str]) -> bool:
    """True when a lazily created state (SGD's momentum buffer) starts in this step."""
    return any(k in new for k in opt.lazy_states)


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


class FusedStepper:
    """Runs an optimizer's steps on the native kernel, one call per param group."""

    def __init__(self) -> None:
        self._plans: dict[int, tuple[Any, _GroupPlan]] = {}

    def invalidate(self) -> None:
        """Drop every cached plan (the optimizer's states or layout changed)."""
        self._plans.clear()

    def step_group(self, opt: "QOptimizer", group: dict[str, Any]) -> None:
        params = group["params"]
        grads = [p.grad for p in params]
        if any(g is None for g in grads):
            have = tuple(g is not None for g in grads)
            params = [p for p, h in zip(params, have) if h]
            grads = [g for g in grads if g is not None]
            if not params:
                return
        else:
            have = None
        key = (opt._layout_version, have, opt._spec_signature(group))
        cached = self._plans.get(id(group))
        if cached is None or cached[0] != key:
            new = {}
            index = opt._param_index()
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(opt).__name__} does not support sparse gradients")
                reason = unfusable_reason(p)
                if reason is not None:
                    raise RuntimeError(f"{type(opt).__name__}(fused=True): {opt._describe(index[id(p)])} has {reason}")
                new[index[id(p)]] = opt._ensure_state(p, index[id(p)], group)
            plan = _GroupPlan(opt, group, params, new)
            key = (opt._layout_version, have, opt._spec_signature(group))
            if not plan.one_shot:
                self._plans[id(group)] = (key, plan)
            else:
                self._plans.pop(id(group), None)
        else:
            plan = cached[1]
        plan.run(grads, opt._hyper(group), _signed64(opt._seed))


@torch.library.register_fake("qconf::fused_step")
def _fused_step_fake(rule, params, grads, steps, states, meta, tables, hyper, seed):  # noqa: ANN001
    return None


@torch.library.register_fake("qconf::encode")
def _encode_fake(x, table, codec, noise):  # noqa: ANN001
    bits, num_scales = codec[0], codec[7]
    return (x.new_empty(((x.numel() * bits + 7) // 8,), dtype=torch.uint8),
            x.new_empty((num_scales,), dtype=torch.float32))


@torch.library.register_fake("qconf::decode")
def _decode_fake(codes, scales, table, codec, shape):  # noqa: ANN001
    return scales.new_empty(tuple(shape), dtype=torch.float32)
