"""Rank functions of tests/test_distributed_fsdp.py (module level, so spawned processes import them).

The model is a small transformer-like stack whose parameters cover the cases of the sharded
semantics on 2 ranks: dim 0 not divisible by the world size (head: 61 rows), shards that start
inside a group block (mlp weights: 3600 = 28.1 blocks of 128), parameters under ``min_numel``
(biases, proj), one quantized only through an override (head.weight) and one with its own codec
through an override (mlp.0.weight: 8-bit exp_avg).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import qconf.optim as qo
from qconf.codec import QTensor

VOCAB, DIM, SEQ = 61, 48, 12

QCONFIG = {
    "min_numel": 4096,
    "states": {"exp_avg": {"bits": 4, "scale": "group", "group_size": 128},
               "exp_avg_sq": {"bits": 4, "map": "power-1", "signed": False, "scale": "rank1"}},
    "overrides": [{"match": "head.weight", "enable": True},
                  {"match": "block.mlp.0.weight", "states": {"exp_avg": {"bits": 8, "group_size": 64}}}],
}
#: stochastic rounding of states and bf16-free weights: draws by global element index
QCONFIG_SR = {**QCONFIG, "states": {"exp_avg": {"bits": 4, "scale": "group", "rounding": "stochastic"},
                                    "exp_avg_sq": {"bits": 4, "map": "power-1", "signed": False, "scale": "dim1",
                                                   "rounding": "stochastic"}}}

#: group blocks of 16 elements, on which every shard boundary of the model falls (mlp: 3600, head:
#: 1488 elements), so the fused kernel steps every shard; rank-1 scales are shared by both ranks
QCONFIG_ALIGNED = {**QCONFIG,
                   "states": {"exp_avg": {"bits": 4, "scale": "group", "group_size": 16, "rounding": "stochastic"},
                              "exp_avg_sq": {"bits": 4, "map": "power-1", "signed": False, "scale": "rank1",
                                             "rounding": "stochastic"}},
                   "overrides": [{"match": "head.weight", "enable": True},
                                 {"match": "block.mlp.0.weight", "states": {"exp_avg": {"bits": 8}}}]}
#: bf16 weights: stochastic rounding of the updates, or Kahan compensation buffers
QCONFIG_SR_WEIGHTS = {**QCONFIG_ALIGNED, "weights": {"rounding": "stochastic"}}
QCONFIG_KAHAN = {**QCONFIG, "weights": {"compensation": "kahan"}}
#: tensor scales, shared by the ranks: those states take the reference path (fused=None)
QCONFIG_TENSOR = {**QCONFIG_ALIGNED, "states": {**QCONFIG_ALIGNED["states"],
                                                "exp_avg_sq": {"bits": 4, "map": "power-1", "signed": False,
                                                               "scale": "tensor"}}}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 150), torch.nn.GELU(), torch.nn.Linear(150, DIM))
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) / DIM**0.5, dim=-1) @ v
        x = x + self.proj(a)
        return x + self.mlp(x)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.block = Block()
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.block(self.emb(tokens[:, :-1])))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def make_model(dtype: torch.dtype = torch.float32) -> Model:
    torch.manual_seed(0)
    return Model().to(dtype)


def batch(step: int, rank: int = 0, world: int = 1, size: int = 8) -> torch.Tensor:
    """Rows ``rank::world`` of the global batch of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g)[rank::world]


def global_grads(step: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Seeded gradients for every parameter, some large (a wide range of scales)."""
    g = torch.Generator().manual_seed(500 + step)
    return {n: torch.randn(p.shape, generator=g) * (30.0 if "mlp" in n else 1.0) for n, p in model.named_parameters()}


def make_optimizer(model: torch.nn.Module, qconfig: dict, fused: bool | None = None) -> qo.AdamW:
    return qo.AdamW(model.named_parameters(), lr=3e-3, weight_decay=0.01, qconfig=qconfig, seed=7, fused=fused)


def shard(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_states(opt: qo.AdamW, model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """Every parameter's states as the unsharded run stores them: QTensors as (packed codes,
    scales, codec) from the full state dict, dense states as full tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from qconf.codec import Codec
    from qconf.optim.records import flat_codes

    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {}
    for name, entry in sd["state"].items():
        rec = {}
        for key, v in entry.items():
            if isinstance(v, dict):
                packed = flat_codes(v, Codec.from_dict(v["codec"]), v["shape"])
                rec[key] = ("q", packed, v["scales"], v["codec"])
            else:
                rec[key] = ("t", v)
        out[name] = rec
    return out


def unsharded_states(opt: qo.AdamW, model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """The same view of an unsharded optimizer."""
    out = {}
    for name, p in model.named_parameters():
        rec = {}
        for key, v in opt.state[p].items():
            rec[key] = ("q", v.codes, v.scales, v.codec.to_dict()) if isinstance(v, QTensor) else ("t", v)
        out[name] = rec
    return out


def plans(opt: qo.AdamW) -> list[list[tuple[str, object]]]:
    """Each parameter's planned states and codecs (the quantize decision)."""
    return [[(spec.key, codec) for spec, codec in opt.planned_states(i)] for i in range(len(opt._named_params()))]


def step_with_grads(opt: qo.AdamW, model: torch.nn.Module, steps: int) -> None:
    """``steps`` steps fed the seeded global gradients (each rank its shard of them)."""
    from torch.distributed.tensor import DTensor

    for s in range(steps):
        grads = global_grads(s, model)
        for n, p in model.named_parameters():
            g = grads[n].to(p.dtype)
            if isinstance(p, DTensor):
                rows = p.to_local().shape[0]
                start = dist.get_rank() * -(-p.shape[0] // dist.get_world_size())
                g = DTensor.from_local(g[start:start + rows].contiguous(), p.device_mesh, p.placements,
                                       shape=p.shape, stride=p.stride())
            p.grad = g
        opt.step()


def train(opt: qo.AdamW, model: torch.nn.Module, steps: int, first: int, rank: int, world: int) -> list[float]:
    """``steps`` training steps through backward on rows ``rank::world`` of each global batch;
    returns the global mean losses."""
    losses = []
    for s in range(first, first + steps):
        loss = model(batch(s, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(float(total))
    return losses
