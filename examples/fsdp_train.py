"""Train a small transformer with FSDP2 (``fully_shard``) under graddbg.watch; rank 0 writes
one HTML report and prints a summary.

    torchrun --nproc-per-node=2 examples/fsdp_train.py
    torchrun --nproc-per-node=2 --master-addr=127.0.0.1 --master-port=29512 \\
        examples/fsdp_train.py --steps 6 --out graddbg-out/fsdp-report.html

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. On GPUs the same code runs
with NCCL, one GPU per process (LOCAL_RANK); without them, with gloo on the CPU.

Under sharding each rank holds a shard of every gradient; graddbg records the statistics of
the full, unsharded gradient (the same table on every rank) from one small all-gather per
recorded step, a few bytes per parameter, never the gradients themselves.
"""
from __future__ import annotations

import argparse
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import graddbg

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 16, 8


class TinyLM(nn.Module):
    """A next-token model: embedding, a few pre-norm encoder layers with a causal mask, head;
    returns ``[batch * seq, vocab]`` logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=2 * DIM, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        # (logits as [batch * seq, vocab] from a 2-D input: a plain tensor, not a view,
        # which FSDP2 would warn about at the root's output)
        return self.head(self.norm(h).reshape(-1, DIM))


def setup() -> torch.device:
    """The process group from torchrun's environment: NCCL and this process's GPU when
    there are GPUs, else gloo on the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=120))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    return device


def build(device: torch.device) -> nn.Module:
    """The same initial weights on every rank, then sharded: each layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int, device: torch.device):
    """Synthetic tokens (a different batch on each rank, as data parallelism has it): a
    noisy counting sequence, so that the loss can fall."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(tokens.shape, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=g), tokens)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def train(model: nn.Module, steps: int, device: torch.device):
    """``steps`` optimizer steps under graddbg.watch; returns the watch and the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rank, losses = dist.get_rank(), []
    with graddbg.watch(model, opt, update_every=1) as w:
        for step in range(steps):
            x, y = batch(step, rank, device)
            loss = F.cross_entropy(model(x), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return w, losses


def summarize(w, losses, out: str) -> None:
    """Rank 0's report and printed summary."""
    path = w.report(out)
    steps = w.steps
    print(f"graddbg FSDP2 example: {dist.get_world_size()} ranks, {len(steps)} steps, "
          f"{w.stats['name'].nunique()} parameters")
    for (_, row), loss in zip(steps.iterrows(), losses):
        print(f"step {int(row['step'])}: loss(rank 0) {loss:.4f}  global norm {row['global_norm']:.6g}")
    print(f"anomalies: {len(w.anomalies)}")
    for a in w.anomalies:
        print(f"  {a}")
    print(f"report: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join("graddbg-out", "fsdp-report.html"))
    args = ap.parse_args(argv)
    device = setup()
    try:
        w, losses = train(build(device), args.steps, device)
        if dist.get_rank() == 0:
            summarize(w, losses, args.out)
        norms = w.steps["global_norm"].to_numpy()
        if not all(math.isfinite(v) for v in norms):
            return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
