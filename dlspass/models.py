"""Small bundled models for the demo, the tests and the benchmarks (own code, no downloads)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MLP(nn.Module):
    """Two hidden layers with ReLU: the smallest model that has a real backward."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class SmallCNN(nn.Module):
    """Conv + BatchNorm + pooling classifier (BatchNorm buffers advance in training).

    The convolutions have no bias: BatchNorm cancels it, so its gradient is pure rounding noise
    that Adam would amplify into differences between equally valid implementations.
    """

    def __init__(self, in_ch: int = 1, n_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.head = nn.Linear(2 * width, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = x.mean(dim=(2, 3))
        return self.head(x)


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        # no bias: the key bias has an exactly-zero gradient (softmax ignores it), and Adam turns
        # that rounding noise into meaningless differences between implementations
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.n_head
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style decoder (explicit attention, so every matmul is visible to the passes)."""

    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 2, n_head: int = 2,
                 block_size: int = 32) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class MHABlock(nn.Module):
    """A pre-norm decoder block on ``nn.MultiheadAttention`` (torch's fused attention kernels)."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class MHAGPT(nn.Module):
    """A GPT decoder as users write it with ``nn.MultiheadAttention`` (causal, no dropout)."""

    def __init__(self, vocab: int = 64, d: int = 64, n_layer: int = 2, n_head: int = 4,
                 block_size: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(MHABlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.ln_f(x))


def gpt_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Next-token cross-entropy for ``batch = (idx, targets)``."""
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mse_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def mse_train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Tensor, Tensor], Tensor]:
    """``step(x, y)``: an MSE loss, its backward and ``optimizer.step()``, written as a user
    writes it, for ``dlspass.compile`` to compile whole; returns the detached loss."""

    def train_step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step


def gpt_train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Tensor, Tensor], Tensor]:
    """``step(idx, targets)``: `gpt_loss`, its backward and ``optimizer.step()``, written as a
    user writes it, for ``dlspass.compile`` to compile whole; returns the detached loss."""

    def train_step(idx: Tensor, targets: Tensor) -> Tensor:
        loss = gpt_loss(model, (idx, targets))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step


def ce_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def copy_task_batch(vocab: int, batch: int, seq: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A learnable synthetic language task: the sequence repeats its first half."""
    half = torch.randint(0, vocab, (batch, (seq + 2) // 2), generator=generator)
    seqs = torch.cat([half, half], dim=1)[:, : seq + 1]
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
