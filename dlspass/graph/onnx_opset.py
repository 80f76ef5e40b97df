"""``default_opset``: the ONNX opset an onnx_ir model imports, for the ONNX passes' new nodes.

The ONNX passes (``passes/*_onnx_pass.py``) export pieces with ``torch.onnx`` and graft them into
the user's model: both must use the opset the model already imports.
"""

from __future__ import annotations

import onnx_ir as ir


def default_opset(model: ir.Model) -> int:
    """The model's version of the default ONNX domain (18 when it imports none)."""
    return next((v for d, v in model.opset_imports.items() if d in ("", "ai.onnx")), 18)
