"""``quiet_torch``: torch's loggers and warnings silenced while dlspass reads, exports or traces.

``torch.export.load`` logs a traceback before it raises, a failed ``torch.export.export`` prints
the partial graph, and the ONNX exporter and onnx_ir log progress: an input error must stay one
line on stderr. Every layer that calls into them (the file readers here, the passes that export
an ONNX tail, the front ends, the CLI) imports this module downwards.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

_LOGGERS = ("torch", "torch.export", "torch._export", "torch._export.serde.serialize",
            "torch.export._trace", "torch._dynamo", "torch.onnx", "onnxscript", "onnx_ir")


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Silence torch's loggers and warnings (``torch.export.load`` logs a traceback before raising)."""
    saved = {n: logging.getLogger(n).level for n in _LOGGERS}
    ctx = warnings.catch_warnings()
    try:
        ctx.__enter__()
        warnings.simplefilter("ignore")
        for n in _LOGGERS:
            logging.getLogger(n).setLevel(logging.CRITICAL + 1)
        yield
    finally:
        ctx.__exit__(None, None, None)
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)
