"""Mixed-precision policy as data: which ATen ops run in 16 bits, which stay float32, which are views.

The lists follow torch's autocast (``aten/src/ATen/autocast_mode.cpp`` and ``autocast_mode.h``,
torch 2.13: the ``lower_precision_fp`` list, and the ``fp32`` and ``fp32_set_opt_dtype`` lists
of CUDA) written at the ATen level of a captured training step, forward and backward:

- ``DEFAULT_LOWER_OPS`` take 16-bit inputs and give 16-bit outputs with float32 accumulation
  (mm, addmm, bmm, baddbmm, convolutions, attention, and their backward ops), so gradients
  really live in 16 bits and can underflow;
- ``FP32_OPS`` run in float32 whatever their inputs (softmax and log_softmax, layer and group
  norm, losses, sums, means, variances, exp/log/pow and the other ops autocast widens), forward
  and backward: CUDA autocast's lists. On CPU, autocast runs the pointwise math of that list
  (``FP32_POINTWISE_OPS``: exp, log, pow, rsqrt, ...) in its inputs' dtype, and so does
  ``policy_for(fmt, "cpu")`` (``CPU_FP32_OPS``): a tanh GELU (``pow(x, 3)``) then stays
  16-bit, as do the values its backward reads. The norms, softmax, reductions and losses stay
  float32 on every device (CPU autocast's layer norm is a mixed-dtype kernel, 16-bit input with
  float32 weight and statistics, which 16-bit casts of the weight do not reproduce);
- everything else runs in the dtype its inputs have (type promotion: an elementwise op between
  two 16-bit ops stays 16-bit, one that also reads a float32 value is float32), as under
  autocast. BatchNorm is in no list, as in autocast: its kernels take 16-bit inputs with float32
  weights and statistics.

The optimizer, all DLS math and the master weights stay float32: the native lowering
(``LowerPrecisionPass``) runs every node with a step role in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dlspass.config import NATIVE_FORMATS

aten = torch.ops.aten

NATIVE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in NATIVE_FORMATS}
"""The torch dtype of each format with one (``dlspass.config.NATIVE_FORMATS``)."""


def _ops(*names: str) -> frozenset:
    """The overloads ``packet.overload`` (``packet`` alone: every overload) this torch has."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is None:
            continue
        if overload:
            if hasattr(op, overload):
                found.append(getattr(op, overload))
        else:
            found += [getattr(op, o) for o in op.overloads()]
    return frozenset(found)


DEFAULT_LOWER_OPS = _ops(
    "mm.default", "addmm.default", "_addmm_activation.default", "bmm.default", "baddbmm.default",
    "addbmm.default", "mv.default", "addmv.default", "matmul.default", "linear.default",
    "convolution.default", "_convolution.default", "convolution_backward.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_cudnn_attention.default",
    "_scaled_dot_product_flash_attention_backward.default",
    "_scaled_dot_product_flash_attention_for_cpu_backward.default",
    "_scaled_dot_product_efficient_attention_backward.default",
    "_scaled_dot_product_cudnn_attention_backward.default",
)

# Float arguments of lowered ops that keep their dtype: the attention kernels' softmax
# statistics are float32 in the forward's output and must stay so in the backward's input.
KEEP_DTYPE_ARGS = frozenset({"logsumexp"})

# CUDA autocast's fp32 list: transcendental and pow (pointwise). CPU autocast (torch 2.13) runs
# them in their inputs' dtype.
FP32_POINTWISE_OPS = _ops(
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "softplus_backward",
)

FP32_OPS = FP32_POINTWISE_OPS | _ops(
    # softmax (fp32_set_opt_dtype) and its backward
    "_softmax", "_log_softmax", "_safe_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data", "logsumexp",
    # norms and their statistics
    "native_layer_norm", "native_layer_norm_backward", "native_group_norm",
    "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
    "var_mean", "var", "std", "std_mean", "linalg_vector_norm", "norm", "renorm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "dist", "_pdist_forward", "_cdist_forward",
    # losses, forward and backward
    "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
    "mse_loss", "mse_loss_backward", "l1_loss", "smooth_l1_loss", "smooth_l1_loss_backward",
    "huber_loss", "huber_loss_backward", "binary_cross_entropy", "binary_cross_entropy_backward",
    "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss", "soft_margin_loss_backward",
    "multi_margin_loss", "multi_margin_loss_backward", "multilabel_margin_loss_forward",
    "multilabel_margin_loss_backward", "poisson_nll_loss", "cosine_embedding_loss",
    "hinge_embedding_loss", "margin_ranking_loss", "triplet_margin_loss",
    # reductions (fp32_set_opt_dtype) and means
    "sum", "mean", "prod", "cumsum", "cumprod",
)

CPU_FP32_OPS = FP32_OPS - FP32_POINTWISE_OPS
"""What the native lowering keeps in float32 on CPU: ``FP32_OPS`` less the pointwise math CPU
autocast runs in 16 bits."""

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
# instead of their output rounds no extra elements, so a weight read as t() in the forward
# and through another view in the backward is rounded once.
WHOLE_VIEW_OPS = VALUE_PRESERVING_OPS - _ops(
    "slice.Tensor", "select.int", "split.Tensor", "split_with_sizes.default",
    "slice_copy.Tensor", "select_copy.int", "split_copy.Tensor", "split_with_sizes_copy.default",
    "clone.default", "contiguous.default",
)


@dataclass(frozen=True)
class PrecisionPolicy:
    """The ops lowered to 16 bits (``lower_ops``), those kept in float32 (``fp32_ops``), and the
    format."""

    fmt: str = "float16"
    lower_ops: frozenset = field(default=DEFAULT_LOWER_OPS)
    fp32_ops: frozenset = field(default=FP32_OPS)

    def lowers(self, target: object) -> bool:
        """True when a node calling ``target`` runs in 16 bits."""
        return target in self.lower_ops

    def keeps_fp32(self, target: object) -> bool:
        """True when a node calling ``target`` runs in float32 whatever its inputs (native mode)."""
        return target in self.fp32_ops


def policy_for(fmt: str, device_type: str) -> PrecisionPolicy:
    """The default policy of a step whose matmuls run on ``device_type`` ("cpu", "cuda", ...):
    autocast's float32 list of that device (CPU's leaves the pointwise math in 16 bits, which is
    also what keeps a tanh GELU's saved values 16-bit there); other devices get CUDA's."""
    return PrecisionPolicy(fmt, fp32_ops=CPU_FP32_OPS if device_type == "cpu" else FP32_OPS)


# ---- attention: the kernel SDPA's dispatch gives 16-bit q, k, v ------------------------------

FLASH = "flash"
KEEP = "keep"
# flash attention's head-dimension bound, and the bound above which its backward needs an
# sm80 or sm90 GPU (on sm86 and sm89 the backward of larger heads does not fit shared memory)
FLASH_MAX_HEAD_DIM = 256
FLASH_SM86_89_MAX_GRAD_HEAD_DIM = 192


def attention_kernel(device_type: str, dtype: torch.dtype, head_dim: int, *, has_bias: bool,
                     dropout_p: float, is_causal: bool, q_len: int, k_len: int,
                     capability: tuple[int, int] | None, needs_grad: bool = True) -> str:
    """``FLASH`` when torch's SDPA dispatch (``sdp_utils``, torch 2.11-2.13) would run flash
    attention on 16-bit q, k, v with these properties on this device, else ``KEEP`` (the kernel
    the trace chose stays).

    Flash attention takes float16 and bfloat16 on CUDA GPUs of compute capability 8.0 or newer,
    no attention mask (bias), head dimensions up to 256 (a multiple of 8: SDPA pads others before
    calling the kernel, the raw op does not), a causal mask only for square attention, and on
    sm86/sm89 a backward only up to head dimension 192. Dropout keeps the traced kernel: the two
    kernels draw their dropout masks from different random streams. ``capability`` None (no GPU
    to ask) keeps.
    """
    if device_type != "cuda" or capability is None or capability < (8, 0):
        return KEEP
    if dtype not in (torch.float16, torch.bfloat16) or has_bias or dropout_p != 0.0:
        return KEEP
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8 != 0:
        return KEEP
    if is_causal and q_len != k_len:
        return KEEP
    if needs_grad and capability in ((8, 6), (8, 9)) and head_dim > FLASH_SM86_89_MAX_GRAD_HEAD_DIM:
        return KEEP
    return FLASH
