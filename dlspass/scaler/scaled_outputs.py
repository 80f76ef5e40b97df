"""What ``GradScaler.scale`` accepts: a tensor or a (nested) list/tuple/dict of tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor

from dlspass.errors import InputTypeError


def tensors_in(obj: Any) -> Iterable[Tensor]:
    """The tensors of ``obj``, a tensor or a (nested) list/tuple/dict of them."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from tensors_in(v)


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``obj`` with ``fn`` applied to each of its tensors, the containers rebuilt as they were;
    anything else is refused, as torch.amp's ``scale`` refuses it."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    raise InputTypeError(f"scale(): expected a tensor or a (nested) list/tuple/dict of tensors, "
                    f"got {type(obj).__name__}")
