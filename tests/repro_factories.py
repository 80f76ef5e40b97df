"""Minimal models that reproduce the CLI failures on outside models (``dlspass export`` factories).

Each ``FACTORY()`` returns ``(model, example_inputs)`` with ``model(*inputs)`` the scalar loss
times ``mult`` (the last input; an inf there forces an overflow step). ``BATCHES[name](step,
mult)`` gives deterministic batches of the example's shapes.

- ``attention``: ``scaled_dot_product_attention`` (bool causal mask) on transposed heads, then
  ``transpose(1, 2).reshape(...).view(...)`` (GPT-2's attention output: export failed in torch's
  flash-attention decomposition, pytorch#136543, and its gradients came out wrong);
- ``tied``: an embedding whose weight is also the output layer's (BERT, T5);
- ``conv_input``: a convolution of the input, which needs no gradient (ViT, ConvNeXt);
- ``conv_bn_linear``: conv -> BatchNorm -> linear (ResNet: BatchNorm's bias gradient also
  feeds the backward);
- ``data_dependent``: Python control flow on a tensor value, which ``torch.export`` refuses;
- ``no_autograd``: a custom op without an autograd formula: export works, the backward fails.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 4)

    def forward(self, x: Tensor, y: Tensor, mult: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, -1))
        causal = torch.ones(s, s, dtype=torch.bool).tril()  # a bool mask, as GPT-2 passes
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        a = a.transpose(1, 2).reshape(b, s, 16)
        return F.mse_loss(self.out(a.view(-1, 16)), y.view(-1, 4)) * mult


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor, labels: Tensor, mult: Tensor) -> Tensor:
        logits = self.head(torch.tanh(self.mid(self.emb(ids))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) * mult


class ConvInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x: Tensor, y: Tensor, mult: Tensor) -> Tensor:
        return F.mse_loss(self.fc(self.conv(x).flatten(1)), y) * mult


class ConvBNLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x: Tensor, y: Tensor, mult: Tensor) -> Tensor:
        return F.mse_loss(self.fc(torch.relu(self.bn(self.conv(x))).flatten(1)), y) * mult


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if h.sum() > 0:  # a branch on a value: torch.export cannot trace it
            h = h * 2
        return h.sum()


@torch.library.custom_op("repro_factories::no_autograd", mutates_args=())
def _no_autograd(x: Tensor) -> Tensor:
    return x * 2


@_no_autograd.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


class NoAutograd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return _no_autograd(self.fc(x)).sum()


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(5000 + step)


def _attention_batch(step: int, mult: float = 1.0) -> tuple[Tensor, ...]:
    g = _gen(step)
    return torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 4, generator=g), torch.tensor(mult)


def _tied_batch(step: int, mult: float = 1.0) -> tuple[Tensor, ...]:
    g = _gen(step)
    return (torch.randint(0, 12, (2, 5), generator=g), torch.randint(0, 12, (2, 5), generator=g),
            torch.tensor(mult))


def _conv_input_batch(step: int, mult: float = 1.0) -> tuple[Tensor, ...]:
    g = _gen(step)
    return torch.randn(2, 3, 6, 6, generator=g), torch.randn(2, 2, generator=g), torch.tensor(mult)


def _made(cls: type[nn.Module], batch: Callable[..., tuple[Tensor, ...]]
          ) -> tuple[nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    return cls(), batch(0)


def attention() -> tuple[nn.Module, tuple[Tensor, ...]]:
    return _made(Attention, _attention_batch)


def tied() -> tuple[nn.Module, tuple[Tensor, ...]]:
    return _made(Tied, _tied_batch)


def conv_input() -> tuple[nn.Module, tuple[Tensor, ...]]:
    return _made(ConvInput, _conv_input_batch)


def conv_bn_linear() -> tuple[nn.Module, tuple[Tensor, ...]]:
    return _made(ConvBNLinear, _conv_input_batch)


def data_dependent() -> tuple[nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    return DataDependent(), (torch.randn(3, 4),)


def no_autograd() -> tuple[nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    return NoAutograd(), (torch.randn(3, 4),)


FACTORIES = {"attention": attention, "tied": tied, "conv_input": conv_input,
             "conv_bn_linear": conv_bn_linear}
BATCHES = {"attention": _attention_batch, "tied": _tied_batch, "conv_input": _conv_input_batch,
           "conv_bn_linear": _conv_input_batch}
