"""A float16 fine-tuning loop on FSDP2 (+ tensor parallelism) with dlspass's eager scaler.

The shape of the verl / torchtitan float16 loops: a device mesh (dp x tp), the TP plan on the
"tp" sub-mesh, ``fully_shard`` per block and at the root on the "dp" sub-mesh with a float16
``MixedPrecisionPolicy`` (float16 compute and all-gathers, float32 gradient reduction), AdamW,
a warm-up schedule held on skipped steps, and a scaler with a long growth interval
(verl: ``ShardedGradScaler(growth_interval=400)``). ``dlspass.GradScaler`` replaces that scaler:
its overflow flag and its global clip norm are agreed over the whole mesh in one all-reduce,
read from every gradient's DTensor placements.

Run (the same code on CPU with gloo and on GPUs with nccl):

    torchrun --nproc-per-node 2 tools/examples/fsdp2_float16_finetune.py
    torchrun --nproc-per-node 4 tools/examples/fsdp2_float16_finetune.py --tp 2

``--inject-inf-at N`` writes an inf into one rank's gradient shard at step N (every rank then
skips that step). Rank 0 prints one line per step; every rank prints a final ``done`` line with
its skipped-step count and a checksum of the whole parameters (equal on all ranks).
``--result-dir DIR`` also writes that rank's final result to ``DIR/rank<N>.json`` (written to a
temporary name and renamed, so a reader sees the whole file or none): what a program reading the
results should use, since the ranks' printed lines share one terminal and may interleave.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dlspass


class Block(nn.Module):
    """A residual MLP block: the layers a TP plan splits column- then row-wise."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyModel(nn.Module):
    def __init__(self, d_in: int = 16, dim: int = 32, n_blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)


def batches(step: int, dp_rank: int, dp: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank), this dp rank's part of it."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 16, generator=g)
    y = x[:, :4].sum(-1) + 0.1 * torch.randn(n, generator=g)
    return x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--inject-inf-at", type=int, default=None)
    parser.add_argument("--result-dir", default=None,
                        help="write each rank's final result to DIR/rank<N>.json")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dp = world // args.tp
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    # --8<-- [start:loop]
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyModel().to(device)
    if args.tp > 1:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                                   "down": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    # verl: ShardedGradScaler(growth_interval=400); torch's scale rule, and the clip norm
    # computed over the whole mesh inside unscale_ (no separate clip_grad_norm_)
    scaler = dlspass.GradScaler(policy="torch", init_scale=2.0**16, steps_per_increase=400,
                                max_gradient_norm=1.0)
    scheduler = dlspass.hold_scheduler_on_skip(scheduler, scaler)

    for step in range(args.steps):
        x, y = batches(step, dp_rank, dp)
        loss = F.mse_loss(model(x.to(device)).float(), y.to(device))
        scaler.scale(loss).backward()
        if step == args.inject_inf_at and rank == world - 1:
            # one rank's gradient shard only: a hardware fault, or a local overflow
            model.blocks[0].up.weight.grad.to_local().view(-1)[0] = float("inf")
        scaler.unscale_(optimizer)  # unscales, agrees on the flag, clips by the global norm
        scaler.step(optimizer)      # skipped on every rank if any rank saw an inf/NaN
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} scale {float(scaler.get_scale()):g} "
                  f"stepped {bool(scaler.stepped(optimizer))}")
    # --8<-- [end:loop]

    checksum = sum(float(p.full_tensor().double().sum()) for p in model.parameters())
    skipped = int(scaler.get_num_skipped_steps())
    print(f"done rank {rank} skipped {skipped} checksum {checksum:.10e} final_loss {loss.item():.6f}",
          flush=True)
    if args.result_dir is not None:
        write_result(args.result_dir, rank, {"rank": rank, "skipped": skipped, "checksum": checksum,
                                             "final_loss": loss.item()})
    dist.destroy_process_group()


def write_result(folder: str, rank: int, result: dict[str, object]) -> None:
    """``result`` as ``folder/rank<rank>.json``, atomically: written under a temporary name in the
    same folder, then renamed over the final one."""
    os.makedirs(folder, exist_ok=True)
    final = os.path.join(folder, f"rank{rank}.json")
    tmp = f"{final}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, final)


if __name__ == "__main__":
    main()
