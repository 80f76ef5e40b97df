"""Tiny transformers models as ``dlspass export`` factories: ``FACTORY()`` -> ``(model, inputs)``.

Each model is built from a small config with random weights (nothing is downloaded) and wrapped
so that ``model(*inputs)`` is the scalar training loss times ``mult`` (a 0-d tensor input: an
inf there overflows the whole backward, which is how the tests inject an overflow step).
``BATCHES[name](step, mult)`` gives deterministic batches of the same shapes as the example.

Models (transformers 5.23.0, Apache-2.0): GPT-2 (``GPT2LMHeadModel``, as shipped), BERT
(``BertForMaskedLM``, embedding tied to the output layer), T5 (``T5ForConditionalGeneration``,
tied), ViT (``ViTForImageClassification``), ResNet (``ResNetForImageClassification``, BatchNorm)
and ConvNeXt (``ConvNextForImageClassification``, LayerNorm).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

VOCAB, BATCH, SEQ, IMAGE, LABELS = 64, 2, 8, 16, 4


class LossOf(nn.Module):
    """``hf_model(**named inputs).loss * mult``: a transformers model as a loss model."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *args: Tensor) -> Tensor:
        *inputs, mult = args
        return self.model(**dict(zip(self.names, inputs, strict=True))).loss * mult


def _tokens(step: int, mult: float) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, labels, torch.tensor(mult)


def _images(step: int, mult: float, size: int = IMAGE) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(4000 + step)
    return (torch.randn(BATCH, 3, size, size, generator=g),
            torch.randint(0, LABELS, (BATCH,), generator=g), torch.tensor(mult))


def _resnet_images(step: int, mult: float) -> tuple[Tensor, ...]:
    return _images(step, mult, 32)


def _lm(step: int, mult: float) -> tuple[Tensor, ...]:
    ids, _, m = _tokens(step, mult)
    return ids, ids, m  # causal LM: labels are the inputs (the model shifts them)


def gpt2() -> tuple[nn.Module, tuple[Tensor, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return LossOf(GPT2LMHeadModel(cfg), ("input_ids", "labels")), _lm(0, 1.0)


def bert() -> tuple[nn.Module, tuple[Tensor, ...]]:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return LossOf(BertForMaskedLM(cfg), ("input_ids", "labels")), _tokens(0, 1.0)


def t5() -> tuple[nn.Module, tuple[Tensor, ...]]:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return LossOf(T5ForConditionalGeneration(cfg), ("input_ids", "labels")), _tokens(0, 1.0)


def vit() -> tuple[nn.Module, tuple[Tensor, ...]]:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=64, num_labels=LABELS,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return LossOf(ViTForImageClassification(cfg), ("pixel_values", "labels")), _images(0, 1.0)


def resnet() -> tuple[nn.Module, tuple[Tensor, ...]]:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                       num_labels=LABELS)
    return (LossOf(ResNetForImageClassification(cfg), ("pixel_values", "labels")),
            _resnet_images(0, 1.0))


def convnext() -> tuple[nn.Module, tuple[Tensor, ...]]:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    cfg = ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=LABELS,
                         image_size=IMAGE)
    return (LossOf(ConvNextForImageClassification(cfg), ("pixel_values", "labels")),
            _images(0, 1.0))


FACTORIES: dict[str, Callable[[], tuple[nn.Module, tuple[Tensor, ...]]]] = {
    "gpt2": gpt2, "bert": bert, "t5": t5, "vit": vit, "resnet": resnet, "convnext": convnext}
BATCHES: dict[str, Callable[[int, float], tuple[Tensor, ...]]] = {
    "gpt2": _lm, "bert": _tokens, "t5": _tokens, "vit": _images, "resnet": _resnet_images,
    "convnext": _images}


# ---- the CLI against eager: shared by the CLI tests and the model matrix ----------------------

def batches(make: Callable[[int, float], tuple[Tensor, ...]], n: int, overflow_at: int | None
            ) -> list[tuple[Tensor, ...]]:
    """``n`` batches of ``make``; step ``overflow_at`` multiplies the loss by inf."""
    return [make(i, float("inf") if i == overflow_at else 1.0) for i in range(n)]


def train_eager(factory: Callable[[], tuple[nn.Module, tuple[Tensor, ...]]], config: object,
                optimizer: object, data: list[tuple[Tensor, ...]]) -> dict[str, object]:
    """Train ``factory()``'s model eagerly with ``dlspass.GradScaler(config=config)`` and the
    optimizer ``optimizer.make(...)`` (an ``OptimizerSpec``), torch.amp's loop; the reference
    for a CLI-built step with the same settings."""
    from dlspass.scaler import GradScaler

    model, _ = factory()
    opt = optimizer.make(list(model.parameters()))  # type: ignore[attr-defined]
    scaler = GradScaler(config=config)  # type: ignore[arg-type]
    losses, scales, skipped = [], [], []
    for batch in data:
        loss = model(*batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        scales.append(float(scaler.get_scale()))
        skipped.append(int(scaler.get_num_skipped_steps()))
    return {"losses": losses, "scales": scales, "skipped": skipped,
            "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "buffers": {k: v.detach().clone() for k, v in model.named_buffers()}}


def train_step_file(path: object, data: list[tuple[Tensor, ...]]) -> dict[str, object]:
    """``cli_factories.train_pt2`` of a step ``.pt2`` over ``data``, with the model's own
    buffers (BatchNorm statistics) apart from dlspass's state."""
    from cli_factories import train_pt2

    got = train_pt2(path, data)  # type: ignore[arg-type]
    got["buffers"] = {k: v for k, v in got.pop("state").items()
                      if k not in got["params"] and not k.startswith("dlspass_")}
    return got


def assert_same_training(got: dict, ref: dict, overflow_at: int | None, rel: float) -> None:
    """``got`` follows ``ref``: the same skips and scales, losses and final parameters (and
    buffers) within ``rel`` of the largest entry, every weight finite; the overflow step's loss
    is non-finite in both."""
    assert got["skipped"] == ref["skipped"]
    assert got["scales"] == ref["scales"]
    if overflow_at is not None:
        assert got["skipped"][overflow_at] == 1 and got["skipped"][-1] == 1
        assert got["scales"][overflow_at] < got["scales"][overflow_at - 1]
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        if i == overflow_at:
            assert not torch.isfinite(torch.tensor([a, b])).any()
        else:
            assert abs(a - b) <= rel * max(abs(b), 1e-6), f"step {i}: loss {a} vs {b}"
    for group in ("params", "buffers"):
        assert set(got[group]) == set(ref[group]), group
        for k, v in ref[group].items():
            assert torch.isfinite(got[group][k]).all(), k
            err = float((got[group][k].double() - v.double()).abs().max())
            assert err <= rel * max(float(v.double().abs().max()), 1e-6), f"{k}: {err}"
