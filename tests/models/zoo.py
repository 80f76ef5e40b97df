"""Outside models for the compatibility matrix: tiny configs, random weights, no downloads.

Each factory returns a `Case`: the model (in training mode, dropout off so that every entry
point sees the same function), one example batch and ``loss_fn(model, batch) -> scalar loss``.
The batch is a tuple of tensors whose LAST element is a 0-d loss multiplier: 1.0 normally,
``inf`` to inject an overflow (the loss times inf makes every gradient inf or NaN), so the
same captured or compiled step serves both without retracing.

The transformers models are built from their own config classes (transformers 5.23.0, the
`test` extra): GPT-2 as shipped (``loss_type`` left at its default), BERT, T5, ViT, ResNet
(BatchNorm) and ConvNeXt (LayerNorm); ``mhagpt`` is a GPT on ``nn.MultiheadAttention``
(``dlspass.models.MHAGPT``). timm is not used: timm 1.0.31 imports torchvision at
import time (``timm/layers/create_norm.py``), and the torchvision wheel on PyPI does not import
beside torch 2.13.0+cpu.

``cli_<name>()`` are `dlspass export` factories: ``(module, example_inputs)`` where
``module(*example_inputs)`` is the loss times the multiplier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

Batch = tuple[Tensor, ...]
LossFn = Callable[[nn.Module, Batch], Tensor]

VOCAB, BATCH, SEQ = 32, 2, 8
# ViT sees 16x16 images (16 patches); the conv nets 32x32, so that BatchNorm's last stage
# normalises over 4x4x2 values (over 2x2x2 the rounding of the lowered formats is amplified
# by BatchNorm's cancellation far beyond the format's round-off)
IMAGE, CONV_IMAGE, CHANNELS, LABELS = 16, 32, 3, 4


@dataclass
class Case:
    """One model of the matrix: the model, an example batch and its loss function."""

    model: nn.Module
    batch: Batch
    loss_fn: LossFn


def _mult(value: float = 1.0) -> Tensor:
    return torch.tensor(float(value))


def _tokens(seed: int, n: int = SEQ) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, n), generator=g)


def _images(seed: int, size: int = IMAGE) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, CHANNELS, size, size, generator=g),
            torch.randint(0, LABELS, (BATCH,), generator=g))


def gpt2() -> Case:
    """transformers' GPT2LMHeadModel with the library's defaults (one block, width 32)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _tokens(1)

    def loss_fn(m: nn.Module, b: Batch) -> Tensor:
        return m(input_ids=b[0], labels=b[0]).loss * b[-1]

    return Case(GPT2LMHeadModel(cfg).train(), (ids, _mult()), loss_fn)


def bert() -> Case:
    """transformers' BertForMaskedLM (embedding and output weights tied, as shipped)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = _tokens(2)

    def loss_fn(m: nn.Module, b: Batch) -> Tensor:
        return m(input_ids=b[0], labels=b[0]).loss * b[-1]

    return Case(BertForMaskedLM(cfg).train(), (ids, _mult()), loss_fn)


def t5() -> Case:
    """transformers' T5ForConditionalGeneration (encoder-decoder, relative attention bias)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1,
                   num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0)
    src, tgt = _tokens(3), _tokens(4, SEQ // 2)

    def loss_fn(m: nn.Module, b: Batch) -> Tensor:
        return m(input_ids=b[0], labels=b[1]).loss * b[-1]

    return Case(T5ForConditionalGeneration(cfg).train(), (src, tgt, _mult()), loss_fn)


def _image_loss(m: nn.Module, b: Batch) -> Tensor:
    return m(pixel_values=b[0], labels=b[1]).loss * b[-1]


def vit() -> Case:
    """transformers' ViTForImageClassification (patch conv on the input, LayerNorm)."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=IMAGE, patch_size=4, num_channels=CHANNELS, hidden_size=32,
                    num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                    num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Case(ViTForImageClassification(cfg).train(), (*_images(5), _mult()), _image_loss)


def resnet() -> Case:
    """transformers' ResNetForImageClassification (basic blocks, BatchNorm in training mode)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(num_channels=CHANNELS, embedding_size=8, hidden_sizes=[8, 16],
                       depths=[1, 1], layer_type="basic", num_labels=LABELS)
    return Case(ResNetForImageClassification(cfg).train(), (*_images(6, CONV_IMAGE), _mult()), _image_loss)


def convnext() -> Case:
    """transformers' ConvNextForImageClassification (depthwise convs, LayerNorm, layer scale)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    cfg = ConvNextConfig(num_channels=CHANNELS, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                         num_labels=LABELS, drop_path_rate=0.0)
    return Case(ConvNextForImageClassification(cfg).train(), (*_images(7, CONV_IMAGE), _mult()), _image_loss)


def mhagpt() -> Case:
    """``dlspass.models.MHAGPT``: a GPT as users write it with ``nn.MultiheadAttention``."""
    import torch.nn.functional as F

    from dlspass.models import MHAGPT

    torch.manual_seed(0)
    ids = _tokens(9, SEQ + 1)

    def loss_fn(m: nn.Module, b: Batch) -> Tensor:
        logits = m(b[0])
        return F.cross_entropy(logits.reshape(-1, VOCAB), b[1].reshape(-1)) * b[-1]

    model = MHAGPT(vocab=VOCAB, d=32, n_layer=1, n_head=2, block_size=SEQ)
    return Case(model.train(), (ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), _mult()), loss_fn)


class GraphBreakNet(nn.Module):
    """Two losses on either side of a dynamo graph break (two compiled graphs per step).

    ``mult`` multiplies only the second graph's loss, so an injected overflow makes the second
    graph's gradients inf while the first graph's stay finite (the shape of issue 13's
    ``make_backend`` report: the first graph's backward runs last).
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 4)

    def forward(self, x: Tensor, mult: Tensor) -> Tensor:
        la = torch.tanh(self.a(x)).pow(2).mean()
        torch._dynamo.graph_break()
        return la + self.b(x).pow(2).mean() * mult


def graph_break() -> Case:
    """`GraphBreakNet` on a fixed batch; the multiplier goes to the second graph's loss."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(8)

    def loss_fn(m: nn.Module, b: Batch) -> Tensor:
        return m(b[0], b[-1])

    return Case(GraphBreakNet().train(), (torch.randn(BATCH, 8, generator=g), _mult()), loss_fn)


MODELS: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2, "bert": bert, "t5": t5, "vit": vit, "resnet": resnet, "convnext": convnext,
    "mhagpt": mhagpt, "graph_break": graph_break,
}


class LossModule(nn.Module):
    """``loss_fn(model, batch)`` as a module whose ``forward(*batch)`` is the loss."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.model = case.model
        self._loss_fn = case.loss_fn

    def forward(self, *batch: Tensor) -> Tensor:
        return self._loss_fn(self.model, batch)


def _cli(name: str) -> Callable[[], tuple[nn.Module, Batch]]:
    def factory() -> tuple[nn.Module, Batch]:
        case = MODELS[name]()
        return LossModule(case), case.batch

    factory.__name__ = factory.__qualname__ = f"cli_{name}"
    return factory


# `dlspass export zoo:cli_<name>` factories, one per model
for _name in MODELS:
    globals()[f"cli_{_name}"] = _cli(_name)


def with_mult(batch: Batch, value: float) -> Batch:
    """``batch`` with its loss multiplier set to ``value``."""
    return (*batch[:-1], _mult(value))


def describe() -> dict[str, Any]:
    """Parameter counts per model (for the docs)."""
    return {name: sum(p.numel() for p in make().model.parameters()) for name, make in MODELS.items()}
