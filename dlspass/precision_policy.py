"""Mixed-precision policy as data: which ATen ops run in 16 bits, and which ops are views.

Like autocast's lists, but for the ATen level of a captured training step: the listed ops take
16-bit inputs and give 16-bit outputs with fp32 accumulation, in the forward AND the backward,
so gradients really live in 16 bits and can underflow. Everything else (reductions, softmax,
norms, losses, the optimizer, all DLS math, the master weights) stays float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

aten = torch.ops.aten

NATIVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _ops(*names: str) -> frozenset:
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            found.append(getattr(op, overload or "default"))
    return frozenset(found)


DEFAULT_LOWER_OPS = _ops(
    "mm.default", "addmm.default", "bmm.default", "baddbmm.default", "matmul.default",
    "convolution.default", "convolution_backward.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_flash_attention_backward.default",
    "_scaled_dot_product_flash_attention_for_cpu_backward.default",
    "_scaled_dot_product_efficient_attention_backward.default",
)

# Ops whose output holds exactly the values of their first input: a rounded value stays rounded.
VALUE_PRESERVING_OPS = _ops(
    "t.default", "view.default", "_unsafe_view.default", "reshape.default", "transpose.int",
    "permute.default", "expand.default", "clone.default", "alias.default", "squeeze.dim",
    "squeeze.dims", "unsqueeze.default", "slice.Tensor", "select.int", "contiguous.default",
    "detach.default", "split.Tensor", "split_with_sizes.default",
    # functionalized graphs (remove="mutations_and_views") spell the views as copies
    "t_copy.default", "view_copy.default", "transpose_copy.int", "permute_copy.default",
    "expand_copy.default", "alias_copy.default", "squeeze_copy.dim", "squeeze_copy.dims",
    "unsqueeze_copy.default", "slice_copy.Tensor", "select_copy.int", "split_copy.Tensor",
    "split_with_sizes_copy.default",
)


# Value-preserving ops that keep every element of their input (no slicing): rounding their input
# instead of their output rounds no extra elements, so a weight read through t() in the forward
# and through another view in the backward is rounded once.
WHOLE_VIEW_OPS = VALUE_PRESERVING_OPS - _ops(
    "slice.Tensor", "select.int", "split.Tensor", "split_with_sizes.default",
    "slice_copy.Tensor", "select_copy.int", "split_copy.Tensor", "split_with_sizes_copy.default",
    "clone.default", "contiguous.default",
)


@dataclass(frozen=True)
class PrecisionPolicy:
    """The ops lowered to 16 bits (``lower_ops``) and the format they are lowered to."""

    fmt: str = "float16"
    lower_ops: frozenset = field(default=DEFAULT_LOWER_OPS)

    def lowers(self, target: object) -> bool:
        """True when a node calling ``target`` runs in 16 bits."""
        return target in self.lower_ops
