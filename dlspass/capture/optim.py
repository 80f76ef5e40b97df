"""Functional twins of ``torch.optim.SGD``, ``Adam`` and ``AdamW`` for whole-step graph capture.

``functionalize(optimizer, param_names)`` returns a ``FunctionalOptimizer`` whose ``update`` is a
pure, ``make_fx``-traceable function of flat tensor dicts (params, grads, optimizer state,
hyperparameters) and reproduces torch 2.13's single-tensor implementations op for op, so a
captured step matches ``optimizer.step()`` within float rounding. The user keeps the real
optimizer: ``state_tensors``/``hyper_tensors`` read it before a step and ``write_back`` stores the
new state in torch's own format, so ``optimizer.state_dict()`` stays right.
``OptimizerSpec`` describes, by value, the optimizer a joint ``.pt2`` program is given
(``dlspass.capture.joint_step.transform_program``, the CLI's ``transform --optimizer``).

Numerics: hyperparameters are 0-d **float64** tensors. torch computes its scalar arithmetic
(``1 - beta2 ** step``, ``lr / bias_correction1``, ``1 - lr * weight_decay``) in Python floats
and casts the result to the parameter dtype only when it meets a tensor; doing that arithmetic in
float32 instead would be off by ~6e-5 relative at step 1 for beta2=0.999 (cancellation in
``1 - beta2``). Float64 0-d tensors follow Python's arithmetic exactly, and type promotion casts
them to the parameter dtype when they meet a parameter-sized tensor, as torch's kernels do.
Capturable Adam (float32 tensor bias corrections on the device) is mirrored as its own path.

Laziness: torch creates optimizer state on a parameter's first real step. Here not-yet-created
state is given as zeros plus a marker: Adam's ``step`` == 0, and for SGD with momentum a bool
``<param>.momentum_initialized`` (torch's first momentum buffer is the gradient itself, not a
blend with zeros). ``write_back`` leaves torch's state absent while the marker says so, so a first
step that DLS skipped creates no state.

Known limits: complex parameters and ``differentiable=True`` are rejected (sparse gradients are
not supported); for float16/bfloat16 parameters the math runs in the parameter dtype (torch's kernels
compute some scalar products in float32), so results agree only to that dtype's rounding.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _get_scalar_dtype

from dlspass.errors import InputKeyError, InputTypeError, InputValueError
from dlspass.files.bounded_text import excerpt

# the torch.optim classes with a functional twin here: the one list capture_step, dlspass.compile
# and the CLI (lower-cased) accept
SUPPORTED_OPTIMIZERS = ("SGD", "Adam", "AdamW")
OPTIMIZER_KINDS = tuple(name.lower() for name in SUPPORTED_OPTIMIZERS)
"""``OptimizerSpec.kind``: the supported optimizers by lower-case name."""

_HYPER_DTYPE = torch.float64


# the optimizer (or one of its options) has no functional twin in dlspass
UnsupportedOptimizerError = InputTypeError


def _unwrapped_step(cls: type) -> Any:
    # Optimizer.__init__ wraps the class's step in a profiling hook; compare the functions beneath.
    return inspect.unwrap(cls.step)


def optimizer_kind(optimizer: Any) -> str | None:
    """``"SGD"`` or ``"Adam"`` (AdamW is Adam with decoupled weight decay in torch 2.13) for an
    optimizer whose step is one of `SUPPORTED_OPTIMIZERS`' (a subclass that keeps its step
    counts), else None. ``capture_step`` and ``dlspass.compile`` both accept by this rule."""
    if isinstance(optimizer, torch.optim.Optimizer):
        step = _unwrapped_step(type(optimizer))
        if isinstance(optimizer, torch.optim.SGD) and step is _unwrapped_step(torch.optim.SGD):
            return "SGD"
        if isinstance(optimizer, torch.optim.Adam) and step is _unwrapped_step(torch.optim.Adam):
            return "Adam"
    return None


def _kind_of(optimizer: Any) -> str:
    kind = optimizer_kind(optimizer)
    if kind is not None:
        return kind
    name = type(optimizer).__name__
    why = " (its step() is overridden)" if isinstance(
        optimizer, (torch.optim.SGD, torch.optim.Adam)) else ""
    raise UnsupportedOptimizerError(
        f"unsupported optimizer {name}{why}: dlspass can capture only torch.optim "
        f"{', '.join(SUPPORTED_OPTIMIZERS)}")


@dataclass(frozen=True)
class GroupPlan:
    """The static (trace-baked) view of one param group."""

    index: int
    names: tuple[str, ...]
    nesterov: bool = False
    maximize: bool = False
    amsgrad: bool = False
    use_momentum: bool = False
    use_weight_decay: bool = False
    decoupled: bool = False
    capturable: bool = False
    fused: bool = False

    def signature(self) -> tuple:
        return (self.names, self.nesterov, self.maximize, self.amsgrad, self.use_momentum,
                self.use_weight_decay, self.decoupled, self.capturable)


def _nonzero(value: Any) -> bool:
    return bool(value != 0)


def _scalar_tensor(value: Any, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().reshape(()).to(device=device, dtype=_HYPER_DTYPE)
    return torch.tensor(float(value), dtype=_HYPER_DTYPE, device=device)


class FunctionalOptimizer:
    """A pure functional twin of a torch.optim SGD/Adam/AdamW; see the module docstring.

    Keys: optimizer state ``"<param>.<key>"`` (SGD: ``momentum_buffer``,
    ``momentum_initialized``; Adam/AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``, and
    ``max_exp_avg_sq`` with amsgrad), hyperparameters ``"group<i>.<name>"`` (SGD: ``lr``,
    ``momentum``, ``dampening``, ``weight_decay``; Adam/AdamW: ``lr``, ``beta1``, ``beta2``,
    ``eps``, ``weight_decay``), in param-group then parameter order.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_names: dict[int, str]) -> None:
        self.optimizer = optimizer
        self.kind = _kind_of(optimizer)
        self._names = dict(param_names)
        self._plans()  # validate now, so a bad optimizer fails at functionalize time

    # ---- static structure -------------------------------------------------------------------

    def _plans(self) -> list[GroupPlan]:
        plans = []
        seen: set[str] = set()
        for gi, group in enumerate(self.optimizer.param_groups):
            names = []
            for p in group["params"]:
                name = self._names.get(id(p))
                if name is None:
                    raise InputValueError(
                        f"param group {gi} of the {type(self.optimizer).__name__} optimizer holds a "
                        f"parameter of shape {tuple(p.shape)} that is not a parameter of the model "
                        "(missing from param_names)")
                if name in seen:
                    raise InputValueError(f"parameter {name!r} appears twice in the optimizer")
                if p.is_complex():
                    raise UnsupportedOptimizerError(
                        f"parameter {name!r} is complex; dlspass's functional optimizers support "
                        "real floating-point parameters only")
                seen.add(name)
                names.append(name)
            if group.get("differentiable", False):
                raise UnsupportedOptimizerError(
                    f"{type(self.optimizer).__name__} with differentiable=True is not supported "
                    f"(param group {gi}); the captured update is not differentiated")
            common = dict(index=gi, names=tuple(names), maximize=bool(group.get("maximize", False)),
                          use_weight_decay=_nonzero(group["weight_decay"]))
            if self.kind == "SGD":
                plans.append(GroupPlan(**common, nesterov=bool(group.get("nesterov", False)),
                                        use_momentum=_nonzero(group["momentum"])))
            else:
                plans.append(GroupPlan(
                    **common, amsgrad=bool(group.get("amsgrad", False)),
                    decoupled=bool(group.get("decoupled_weight_decay", False)),
                    capturable=bool(group.get("capturable", False)),
                    fused=bool(group.get("fused", False))))
        return plans

    def plans(self) -> list[GroupPlan]:
        """The static view of each param group (options a trace bakes in), validated."""
        return self._plans()

    def state_keys(self, plan: GroupPlan) -> tuple[str, ...]:
        """The state ``update_one`` reads and returns for a parameter of ``plan``'s group."""
        return self._state_keys(plan)

    def static_signature(self) -> tuple:
        """Everything ``update`` bakes into a trace; a change means the step must be re-traced."""
        return (self.kind, tuple(p.signature() for p in self._plans()))

    def param_names(self) -> list[str]:
        """Names of the parameters this optimizer updates, in param-group order."""
        return [n for plan in self._plans() for n in plan.names]

    def _state_keys(self, plan: GroupPlan) -> tuple[str, ...]:
        if self.kind == "SGD":
            return ("momentum_buffer", "momentum_initialized") if plan.use_momentum else ()
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if plan.amsgrad else ())

    def hyper_keys(self) -> tuple[str, ...]:
        """The per-group hyperparameter names ``update_one`` reads."""
        return self._hyper_keys()

    def _hyper_keys(self) -> tuple[str, ...]:
        if self.kind == "SGD":
            return ("lr", "momentum", "dampening", "weight_decay")
        return ("lr", "beta1", "beta2", "eps", "weight_decay")

    # ---- reading the torch optimizer --------------------------------------------------------

    def state_tensors(self) -> dict[str, Tensor]:
        """The optimizer state as flat tensors on each parameter's device (read-only views).

        Tensors already in ``optimizer.state`` are returned as they are (Adam's ``step`` is moved
        to the parameter's device as float32); state torch has not created yet is zeros, with
        ``step`` 0 or ``momentum_initialized`` False marking it.
        """
        out: dict[str, Tensor] = {}
        for plan, group in zip(self._plans(), self.optimizer.param_groups, strict=True):
            keys = self._state_keys(plan)
            for name, p in zip(plan.names, group["params"], strict=True):
                st = self.optimizer.state.get(p, {})
                if self.kind == "SGD":
                    if not keys:
                        continue
                    buf = st.get("momentum_buffer")
                    out[f"{name}.momentum_buffer"] = (
                        torch.zeros_like(p, memory_format=torch.preserve_format).detach()
                        if buf is None else buf)
                    out[f"{name}.momentum_initialized"] = torch.tensor(buf is not None, device=p.device)
                    continue
                step = st.get("step")
                if step is None:
                    out[f"{name}.step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                else:
                    out[f"{name}.step"] = torch.as_tensor(step).detach().to(
                        device=p.device, dtype=torch.float32).reshape(())
                for k in keys[1:]:
                    t = st.get(k)
                    out[f"{name}.{k}"] = (torch.zeros_like(p, memory_format=torch.preserve_format)
                                          .detach() if t is None else t)
        return out

    def hyper_tensors(self) -> dict[str, Tensor]:
        """Per-group hyperparameters as 0-d float64 tensors, read fresh from ``param_groups``."""
        out: dict[str, Tensor] = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            params = group["params"]
            device = params[0].device if params else torch.device("cpu")
            values = dict(group)
            if self.kind == "Adam":
                values["beta1"], values["beta2"] = group["betas"]
            for k in self._hyper_keys():
                out[f"group{gi}.{k}"] = _scalar_tensor(values[k], device)
        return out

    # ---- the pure update --------------------------------------------------------------------

    def update(self, params: dict[str, Tensor], grads: dict[str, Tensor],
               state: dict[str, Tensor], hyper: dict[str, Tensor]
               ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """One optimizer step as a pure function: ``(new_params, new_state)``.

        Same keys out as in. Parameters absent from ``grads`` (``p.grad is None`` in torch) and
        parameters the optimizer does not hold are passed through unchanged, as is their state.
        Only static options are read from the optimizer, so ``make_fx`` can trace it.
        """
        new_params = dict(params)
        new_state = dict(state)
        for plan in self._plans():
            h = {k: _need(hyper, f"group{plan.index}.{k}", "hyper") for k in self._hyper_keys()}
            for name in plan.names:
                grad = grads.get(name)
                if grad is None:
                    continue
                param = _need(params, name, "params")
                st = {k: _need(state, f"{name}.{k}", "state") for k in self._state_keys(plan)}
                new_p, new_st = update_one(self.kind, plan, param, grad, st, h)
                new_params[name] = new_p
                for k, v in new_st.items():
                    new_state[f"{name}.{k}"] = v
        return new_params, new_state

    # ---- writing back -----------------------------------------------------------------------

    def write_back(self, new_state: dict[str, Tensor]) -> None:
        """Store ``new_state`` into ``optimizer.state`` in torch.optim's own format.

        State a marker calls uninitialised (``step`` 0, ``momentum_initialized`` False) is not
        created (and is removed if present), matching torch's lazy first step.
        """
        opt = self.optimizer
        # the captured step is this optimizer's step: LR schedulers check this flag to warn
        # about lr_scheduler.step() before optimizer.step()
        opt._opt_called = True  # type: ignore[attr-defined]
        for plan, group in zip(self._plans(), opt.param_groups, strict=True):
            keys = self._state_keys(plan)
            if not keys:
                continue
            for name, p in zip(plan.names, group["params"], strict=True):
                vals = {k: _need(new_state, f"{name}.{k}", "new_state") for k in keys}
                st = opt.state.get(p)
                had = bool(st) and (self.kind != "SGD" or st.get("momentum_buffer") is not None)
                if not had and not _initialized(self.kind, vals):
                    # the only sync, and only until a parameter's first real step
                    if st is not None:
                        for k in keys:
                            st.pop(k, None)
                        if not st:
                            del opt.state[p]
                    continue
                st = opt.state[p]
                if self.kind == "SGD":
                    st["momentum_buffer"] = vals["momentum_buffer"].detach().to(p.dtype)
                    continue
                old_step = st.get("step")
                if isinstance(old_step, Tensor):
                    dtype, device = old_step.dtype, old_step.device
                elif plan.capturable or plan.fused:
                    dtype, device = _scalar_dtype(plan.fused), p.device
                else:
                    dtype, device = _scalar_dtype(False), torch.device("cpu")
                st["step"] = vals["step"].detach().to(device=device, dtype=dtype).reshape(())
                for k in keys[1:]:
                    st[k] = vals[k].detach()


def functionalize(optimizer: torch.optim.Optimizer, param_names: dict[int, str]) -> FunctionalOptimizer:
    """The functional twin of ``optimizer``; ``param_names`` maps ``id(param)`` to its name.

    Raises ``UnsupportedOptimizerError`` for optimizers other than torch.optim SGD/Adam/AdamW
    (or with ``differentiable=True``) and ``ValueError`` for a parameter missing from
    ``param_names``. ``foreach``/``fused`` are accepted: the functional form is the math.
    """
    return FunctionalOptimizer(optimizer, param_names)


# ---- the optimizer a joint .pt2 program is given ------------------------------------------------

def optimizer_value_problem(name: str, value: object) -> str | None:
    """Why ``value`` cannot be ``OptimizerSpec``'s field ``name`` (``"expected ..., got ..."``),
    or None when it can. The one statement of the rule: ``OptimizerSpec`` words a problem with
    its field name, the CLI with its flag. torch.optim refuses negative values but accepts inf
    and nan, and the first step would write them into every weight."""
    if name == "kind":
        return None if value in OPTIMIZER_KINDS else (
            f"unknown optimizer {excerpt(value)}; choose one of {', '.join(OPTIMIZER_KINDS)}")
    if name == "betas":
        if isinstance(value, (tuple, list)) and len(value) == 2 and all(
                _is_real(b) and 0 <= b < 1 for b in value):
            return None
        shown = f"({', '.join(map(excerpt, value))})" if isinstance(value, (tuple, list)) \
            and len(value) <= 3 else excerpt(value)
        return f"expected two numbers in [0, 1), got {shown}"
    positive = name == "lr"
    if _is_real(value) and math.isfinite(value) and (value > 0 if positive else value >= 0):
        return None
    return f"expected a finite number {'> 0' if positive else '>= 0'}, got {excerpt(value)}"


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer ``transform_program`` appends to a joint program (torch.optim semantics);
    a value ``optimizer_value_problem`` refuses is an ``InputValueError`` naming the field."""

    kind: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        for f in fields(self):
            problem = optimizer_value_problem(f.name, getattr(self, f.name))
            if problem is not None:
                raise InputValueError(f"{f.name}: {problem}")

    def make(self, params: list[Tensor]) -> torch.optim.Optimizer:
        """The torch optimizer this spec describes, over ``params``."""
        if self.kind == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                                   weight_decay=self.weight_decay)
        cls = torch.optim.Adam if self.kind == "adam" else torch.optim.AdamW
        return cls(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                   weight_decay=self.weight_decay)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


# ---- per-parameter math, mirroring torch/optim/{sgd,adam}.py _single_tensor_* ------------------


def update_one(kind: str, plan: GroupPlan, param: Tensor, grad: Tensor, st: dict[str, Tensor],
               hyper: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """One parameter's step: ``(new_param, new_state)``; ``st`` holds ``state_keys(plan)``
    (unprefixed) and ``hyper`` the group's 0-d float64 hyperparameters (unprefixed)."""
    if kind == "SGD":
        return _sgd_one(plan, param, grad, st, hyper)
    if plan.capturable:
        return _adam_one_capturable(plan, param, grad, st, hyper)
    return _adam_one(plan, param, grad, st, hyper)


def _need(d: dict[str, Tensor], key: str, what: str) -> Tensor:
    try:
        return d[key]
    except KeyError:
        raise InputKeyError(f"{what} has no entry {key!r}") from None


def _initialized(kind: str, vals: dict[str, Tensor]) -> bool:
    if kind == "SGD":
        return bool(vals["momentum_initialized"])
    return bool(vals["step"] != 0)


def _scalar_dtype(fused: bool) -> torch.dtype:
    return _get_scalar_dtype(is_fused=fused)


def _sgd_one(plan: GroupPlan, param: Tensor, grad: Tensor, st: dict[str, Tensor],
             h: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    if plan.maximize:
        grad = -grad
    if plan.use_weight_decay:
        grad = torch.addcmul(grad, param, h["weight_decay"])
    new_st: dict[str, Tensor] = {}
    if plan.use_momentum:
        momentum = h["momentum"]
        # torch: a first step's buffer is the gradient itself; later ones blend
        blended = torch.addcmul(st["momentum_buffer"] * momentum, grad, 1 - h["dampening"])
        buf = torch.where(st["momentum_initialized"], blended, grad)
        new_st = {"momentum_buffer": buf,
                  "momentum_initialized": torch.ones_like(st["momentum_initialized"])}
        grad = torch.addcmul(grad, buf, momentum) if plan.nesterov else buf
    return torch.addcmul(param, grad, h["lr"], value=-1), new_st


def _adam_moments(plan: GroupPlan, param: Tensor, grad: Tensor, st: dict[str, Tensor],
                  h: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Shared head of both Adam paths: (step, param, grad-applied exp_avg, exp_avg_sq, grad)."""
    if plan.maximize:
        grad = -grad
    step = st["step"] + 1
    if plan.use_weight_decay:
        if plan.decoupled:
            param = param * (1 - h["lr"] * h["weight_decay"])
        else:
            grad = torch.addcmul(grad, param, h["weight_decay"])
    # lerp wants its weight in the tensor's dtype; torch casts the Python float the same way
    exp_avg = torch.lerp(st["exp_avg"], grad, (1 - h["beta1"]).to(param.dtype))
    # torch: addcmul_(grad, grad, value=1 - beta2), computed as self + (value * t1) * t2
    exp_avg_sq = torch.addcmul(st["exp_avg_sq"] * h["beta2"], (1 - h["beta2"]) * grad, grad)
    return step, param, exp_avg, exp_avg_sq, grad


def _adam_one(plan: GroupPlan, param: Tensor, grad: Tensor, st: dict[str, Tensor],
              h: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    step, param, exp_avg, exp_avg_sq, grad = _adam_moments(plan, param, grad, st, h)
    step64 = step.to(_HYPER_DTYPE)  # torch: step.item(), a Python float
    bias_correction1 = 1 - h["beta1"] ** step64
    bias_correction2 = 1 - h["beta2"] ** step64
    step_size = h["lr"] / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    new_st = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if plan.amsgrad:
        second = torch.maximum(st["max_exp_avg_sq"], exp_avg_sq)
        new_st["max_exp_avg_sq"] = second
    denom = second.sqrt() / bias_correction2_sqrt + h["eps"]
    # torch: addcdiv_(exp_avg, denom, value=-step_size), computed as self + (value * t1) / t2
    return torch.addcdiv(param, -step_size * exp_avg, denom), new_st


def _adam_one_capturable(plan: GroupPlan, param: Tensor, grad: Tensor, st: dict[str, Tensor],
                         h: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    # capturable keeps step a float32 tensor, so torch's bias corrections are float32 tensor math
    step, param, exp_avg, exp_avg_sq, grad = _adam_moments(plan, param, grad, st, h)
    f32 = step.dtype
    bias_correction1 = 1 - h["beta1"].to(f32) ** step
    bias_correction2 = 1 - h["beta2"].to(f32) ** step
    # Python `float / tensor` is Tensor.__rtruediv__, i.e. reciprocal(tensor) * float
    step_size_neg = -(bias_correction1.reciprocal() * h["lr"].to(f32))
    bias_correction2_sqrt = bias_correction2.sqrt()
    new_st = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if plan.amsgrad:
        second = torch.maximum(st["max_exp_avg_sq"], exp_avg_sq)
        new_st["max_exp_avg_sq"] = second
    denom = second.sqrt() / (bias_correction2_sqrt * step_size_neg) + step_size_neg.reciprocal() * h["eps"].to(f32)
    return torch.addcdiv(param, exp_avg, denom), new_st
