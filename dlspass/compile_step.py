"""``dlspass.compile``: a whole training step compiled as one graph, dynamic loss scaling included.

The user writes an ordinary eager step (forward, ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad()``, ``return loss.detach()``). torch 2.13 can trace that as one graph only
with ``trace_autograd_ops`` on and without ``torch.optim``'s own ``step`` (it graph-breaks on
purpose), so while the compiled step runs:

1. ``optimizer.step`` / ``optimizer.zero_grad`` are replaced on the instance by a pure
   functional update (SGD, Adam, AdamW) that reads the learning rate from 0-d tensors (graph
   inputs: a scheduler changing lr does not recompile) and writes parameters, optimizer state
   and the (passed-through) scaler state back in place, which AOTAutograd turns into graph
   outputs;
2. parameters, gradients, optimizer state, scaler state, hyperparameters and updates are
   wrapped in ``dlspass.marks.mark`` so the AOTAutograd graph carries roles;
3. the AOT forward compiler (``tag_aot_graph``) moves those roles onto placeholders and
   outputs, tags the backward seed (the ``ones_like(loss)`` every gradient depends on) and runs
   ``dlspass.passes.apply_dls``: 16-bit lowering, seed scaling, unscale and overflow check,
   clipping, ``where``-guarded updates (a skipped step leaves parameters and optimizer state
   bit-identical, with no clones) and the scale update, all on device with no host sync; the
   graph then goes to inductor (or runs as is with ``backend_compiler="eager"``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from . import roles, scale_policy
from .config import ConfigError, DLSConfig
from .marks import mark, resolve_marks

BACKEND_COMPILERS = ("inductor", "eager")
SUPPORTED_OPTIMIZERS = ("torch.optim.SGD", "torch.optim.Adam", "torch.optim.AdamW")


class CompileError(RuntimeError):
    """The training step cannot be compiled as one dlspass graph; the message says why."""


# ---- configuration ---------------------------------------------------------------------------

def resolve_config(
    scaler: Any | None,
    fp16_type: str | None = None,
    mixed_precision: bool | None = None,
    max_gradient_norm: float | None = None,
) -> DLSConfig:
    """The step's ``DLSConfig``: the scaler's, with the keyword options applied.

    A keyword that would change what the scaler already decided (its scale range, whether it
    scales at all, a different clipping norm) is a ``ConfigError``: build the scaler with it.
    Without a scaler the step runs without loss scaling.
    """
    if scaler is None:
        return DLSConfig(
            loss_scale=None,
            fp16_type=fp16_type or "float16",
            # without a scaler, lowering happens only when asked for
            mixed_precision=(fp16_type is not None) if mixed_precision is None else mixed_precision,
            max_gradient_norm=max_gradient_norm,
        )
    base = getattr(scaler, "config", None)
    if not isinstance(base, DLSConfig) or not hasattr(scaler, "state"):
        raise ConfigError(
            f"scaler: expected a dlspass.GradScaler (with .config and .state), got {type(scaler).__name__}"
        )
    cfg = base
    if fp16_type is not None and fp16_type != base.fp16_type:
        cfg = dataclasses.replace(cfg, fp16_type=fp16_type)
        old = (base.enabled, base.dynamic, base.init_scale, base.min_scale, base.max_scale)
        new = (cfg.enabled, cfg.dynamic, cfg.init_scale, cfg.min_scale, cfg.max_scale)
        if old != new:
            raise ConfigError(
                f"fp16_type={fp16_type!r} conflicts with the scaler's fp16_type={base.fp16_type!r} "
                "(it changes the loss-scale range); construct dlspass.GradScaler(fp16_type="
                f"{fp16_type!r}) instead"
            )
    if max_gradient_norm is not None:
        if base.max_gradient_norm is not None and base.max_gradient_norm != max_gradient_norm:
            raise ConfigError(
                f"max_gradient_norm={max_gradient_norm!r} conflicts with the scaler's "
                f"max_gradient_norm={base.max_gradient_norm!r}"
            )
        cfg = dataclasses.replace(cfg, max_gradient_norm=max_gradient_norm)
    if mixed_precision is not None:
        cfg = dataclasses.replace(cfg, mixed_precision=mixed_precision)
    return cfg


# ---- functional optimizers ---------------------------------------------------------------------

def _check_optimizer(optimizer: Any) -> str:
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return "sgd"
    if kind is torch.optim.AdamW:
        return "adamw"
    if kind is torch.optim.Adam:
        return "adam"
    raise CompileError(
        f"optimizer: {kind.__module__}.{kind.__qualname__} has no functional form in dlspass; "
        f"supported: {', '.join(SUPPORTED_OPTIMIZERS)}"
    )


def _materialize_state(optimizer: torch.optim.Optimizer, kind: str) -> None:
    """Create the optimizer state torch would create lazily, so the graph can carry it."""
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise CompileError("optimizer: differentiable=True is not supported by dlspass.compile")
        for p in group["params"]:
            st = optimizer.state[p]
            if kind == "sgd":
                if group["momentum"] != 0 and st.get("momentum_buffer") is None:
                    if group["dampening"] != 0:
                        # torch seeds the buffer with the first gradient undamped; a zero
                        # buffer reproduces that only without dampening
                        raise CompileError(
                            "optimizer: SGD with dampening != 0 needs its momentum buffers; run "
                            "one eager step first or use dampening=0"
                        )
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif len(st) == 0:
                # on the parameter's device, so the step count never needs a host round trip
                st["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _sgd(p: Tensor, g: Tensor, st: dict, group: dict, lr: Tensor) -> tuple[Tensor, dict]:
    if group["maximize"]:
        g = -g
    if group["weight_decay"] != 0:
        g = g + group["weight_decay"] * p
    new_st = {}
    if group["momentum"] != 0:
        buf = st["momentum_buffer"] * group["momentum"] + (1 - group["dampening"]) * g
        new_st["momentum_buffer"] = buf
        g = g + group["momentum"] * buf if group["nesterov"] else buf
    return p - lr * g, new_st


def _adam(p: Tensor, g: Tensor, st: dict, group: dict, lr: Tensor, decoupled: bool) -> tuple[Tensor, dict]:
    beta1, beta2 = group["betas"]
    wd, eps = group["weight_decay"], group["eps"]
    if group["maximize"]:
        g = -g
    step = st["step"] + 1
    if wd != 0:
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
    exp_avg = torch.lerp(st["exp_avg"], g, 1 - beta1)
    exp_avg_sq = st["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
    bc1 = 1 - torch.pow(beta1, step)
    bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, step))
    new_st = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if group["amsgrad"]:
        second = torch.maximum(st["max_exp_avg_sq"], exp_avg_sq)
        new_st["max_exp_avg_sq"] = second
    denom = torch.sqrt(second) / bc2_sqrt + eps
    return p - (lr / bc1) * exp_avg / denom, new_st


# ---- the traced step ---------------------------------------------------------------------------

class _StepContext:
    """What the intercepted optimizer calls read while dynamo traces: plain attributes only."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, scaler: Any, config: DLSConfig,
                 names: dict[int, str]) -> None:
        self.optimizer = optimizer
        self.kind = kind
        self.scaler = scaler
        self.config = config
        self.names = names
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
        if scaler is not None and device is not None and scaler.state.loss_scale.device != device:
            # the state must live beside the parameters: the step reads and writes it in-graph
            scaler.state = scale_policy.ScalerState(*(t.to(device) for t in scaler.state))
        self.state = scaler.state if scaler is not None else scale_policy.init_state(config, device)
        # a tensor lr is read as is; a float lr gets a 0-d tensor refreshed before each call
        self.lr = [g["lr"] if isinstance(g["lr"], Tensor)
                   else torch.tensor(float(g["lr"]), device=device)
                   for g in optimizer.param_groups]
        # the traced code reads these copies, never param_groups itself: dynamo guards every
        # value of a dict it iterates, so reading a group would bake lr in as a constant
        self.params = [list(g["params"]) for g in optimizer.param_groups]
        self.hyper: list[dict[str, Any]] = [{} for _ in optimizer.param_groups]
        self.refresh()

    def refresh(self) -> None:
        for t, hyper, group in zip(self.lr, self.hyper, self.optimizer.param_groups, strict=True):
            if not isinstance(group["lr"], Tensor):
                t.fill_(float(group["lr"]))
            current = {k: v for k, v in group.items() if k not in ("params", "lr")}
            if current != hyper:  # other hyperparameters stay constants: a change recompiles
                hyper.clear()
                hyper.update(current)
        if self.scaler is not None:
            self.state = self.scaler.state

    def step(self, *args: Any, **kwargs: Any) -> None:
        """The optimizer step as a plain functional update, every value marked with its role.

        Traced by dynamo in place of ``optimizer.step``; ``apply_dls`` adds DLS afterwards.
        """
        if args or kwargs:
            raise CompileError("optimizer.step(closure) is not supported inside dlspass.compile")
        opt = self.optimizer
        with torch.no_grad():
            for gi, (params, group) in enumerate(zip(self.params, self.hyper, strict=True)):
                lr = mark(self.lr[gi], roles.HYPER, f"group{gi}.lr")
                for p in params:
                    if p.grad is None:
                        continue
                    name = self.names[id(p)]
                    g = mark(p.grad, roles.GRAD, name)
                    old = mark(p, roles.PARAM, name)
                    st = {k: mark(v, roles.OPT_STATE, f"{name}.{k}") for k, v in opt.state[p].items()}
                    if self.kind == "sgd":
                        new_p, new_st = _sgd(old, g.to(p.dtype), st, group, lr)
                    else:
                        new_p, new_st = _adam(old, g.to(p.dtype), st, group, lr, self.kind == "adamw")
                    p.copy_(mark(new_p, roles.PARAM_UPDATE, name))
                    for k, v in new_st.items():
                        opt.state[p][k].copy_(mark(v, roles.OPT_STATE_UPDATE, f"{name}.{k}"))
            if not self.config.enabled:
                return
            for t, field in zip(self.state, scale_policy.STATE_FIELDS, strict=True):
                # the state passes through; UpdateScalePass replaces these outputs
                t.copy_(mark(mark(t, roles.SCALER_STATE, field), roles.SCALER_STATE_UPDATE, field))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for params in self.params:
            for p in params:
                p.grad = None


# ---- the AOT graph rewrite ----------------------------------------------------------------------

def find_seed(graph: fx.Graph) -> fx.Node:
    """The backward seed: the ``ones_like`` of a 0-d value that every gradient depends on."""
    grads = roles.nodes_with_role(graph, roles.GRAD)
    if not grads:
        raise CompileError("the step computes no gradients: call loss.backward() before optimizer.step()")
    ancestors: set[fx.Node] | None = None
    for g in grads:
        seen: set[fx.Node] = set()
        stack = [g]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        ancestors = seen if ancestors is None else ancestors & seen
    assert ancestors is not None
    seeds = [n for n in ancestors if n.op == "call_function"
             and n.target in (torch.ops.aten.ones_like.default, torch.ops.aten.full_like.default)]
    if len(seeds) != 1:
        raise CompileError(f"expected one backward seed (ones_like(loss)) in the step, found {len(seeds)}: "
                           "call loss.backward() exactly once on a scalar loss")
    return seeds[0]


_UPDATE_OF = {roles.PARAM: roles.PARAM_UPDATE, roles.OPT_STATE: roles.OPT_STATE_UPDATE,
              roles.SCALER_STATE: roles.SCALER_STATE_UPDATE}


def tag_aot_graph(gm: fx.GraphModule) -> None:
    """Give the AOTAutograd step graph the role contract ``apply_dls`` reads (dlspass.roles).

    Placeholder roles move from their markers onto the placeholders; the outputs AOT returns
    for mutated inputs (``copy(placeholder, new)``) get the update role of their placeholder,
    the rest are user outputs (LOSS); the backward seed gets SEED.
    """
    resolve_marks(gm)
    graph = gm.graph
    for node in list(graph.nodes):
        src = node.args[0] if node.args else None
        if (node.op == "call_function" and node.target is torch.ops.aten.alias.default
                and isinstance(src, fx.Node) and src.op == "placeholder"
                and roles.role_of(node) in roles.PLACEHOLDER_ROLES):
            if roles.role_of(src) is None:
                roles.set_role(src, roles.role_of(node), roles.target_of(node))
            node.replace_all_uses_with(src)
            graph.erase_node(node)
    for node in graph.find_nodes(op="placeholder"):
        if roles.role_of(node) is None:
            roles.set_role(node, roles.INPUT, node.name)
    out_roles: list[tuple[str, str | None]] = []
    for val in roles.output_values(graph):
        ph = val.args[0] if (isinstance(val, fx.Node) and val.target is torch.ops.aten.copy.default) else None
        if isinstance(ph, fx.Node) and ph.op == "placeholder" and roles.role_of(ph) in _UPDATE_OF:
            out_roles.append((_UPDATE_OF[roles.role_of(ph)], roles.target_of(ph)))
        else:
            out_roles.append((roles.LOSS, None))
    roles.set_output_roles(graph, out_roles)
    roles.set_role(find_seed(graph), roles.SEED)
    graph.lint()
    gm.recompile()


def _make_fw_compiler(config: DLSConfig, backend_compiler: str, graphs: list[fx.GraphModule]):
    from dlspass.passes import apply_dls

    from . import dynamo_backend

    def fw_compiler(gm: fx.GraphModule, example_inputs: list[Any]):
        tag_aot_graph(gm)
        gm = apply_dls(gm, config)
        graphs.append(gm)
        return dynamo_backend.finish(gm, example_inputs, backend_compiler)

    return fw_compiler


# ---- public entry point ----------------------------------------------------------------------

class CompiledStep:
    """The callable ``dlspass.compile`` returns: call it like the original step."""

    def __init__(self, fn: Callable, optimizer: torch.optim.Optimizer, scaler: Any,
                 config: DLSConfig, backend_compiler: str) -> None:
        kind = _check_optimizer(optimizer)
        _materialize_state(optimizer, kind)
        names = {}
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                names[id(p)] = f"group{gi}.param{pi}"
        self.fn = fn
        self.optimizer = optimizer
        self.scaler = scaler
        self.config = config
        self.backend_compiler = backend_compiler
        self.graphs: list[fx.GraphModule] = []  # the rewritten AOT graphs, for inspection
        self._ctx = _StepContext(optimizer, kind, scaler, config, names)
        from torch._dynamo.backends.common import aot_autograd

        backend = aot_autograd(fw_compiler=_make_fw_compiler(config, backend_compiler, self.graphs))
        self._compiled = torch.compile(fn, backend=backend, fullgraph=True)
        functools.update_wrapper(self, fn)
        self.__signature__ = inspect.signature(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        opt = self.optimizer
        self._ctx.refresh()
        had = {k: opt.__dict__[k] for k in ("step", "zero_grad") if k in opt.__dict__}
        opt.step = self._ctx.step
        opt.zero_grad = self._ctx.zero_grad
        try:
            with torch._dynamo.config.patch(trace_autograd_ops=True):
                return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CompileError(
                f"dlspass.compile: the training step is not one graph (graph break: {first}); "
                "dlspass never compiles a step partially. Avoid Python control flow on tensor "
                "values, call loss.backward() once and return loss.detach()"
            ) from e
        finally:
            for k in ("step", "zero_grad"):
                if k in had:
                    setattr(opt, k, had[k])
                else:
                    opt.__dict__.pop(k, None)


def compile(  # noqa: A001 - the public verb is dlspass.compile
    fn: Callable,
    *,
    optimizer: torch.optim.Optimizer,
    scaler: Any | None = None,
    fp16_type: str | None = None,
    mixed_precision: bool | None = None,
    max_gradient_norm: float | None = None,
    backend_compiler: str = "inductor",
) -> CompiledStep:
    """Compile a whole eager training step (forward, backward, optimizer, DLS) as one graph.

    ``fn`` must call ``loss.backward()``, ``optimizer.step()`` and ``optimizer.zero_grad()`` and
    return ``loss.detach()`` (or other detached values). Model parameters, optimizer state and
    ``scaler.state`` are updated in place on every call; on overflow the step is skipped.
    ``mixed_precision=False`` keeps the step in float32 (DLS without lowering).
    ``backend_compiler="eager"`` runs the rewritten graph without inductor (fast, for tests).

    Example:
        >>> step = dlspass.compile(train_step, optimizer=opt, scaler=dlspass.GradScaler())
        >>> loss = step(x, y)
    """
    if backend_compiler not in BACKEND_COMPILERS:
        raise ConfigError(
            f"backend_compiler: expected one of {', '.join(BACKEND_COMPILERS)}, got {backend_compiler!r}"
        )
    if not callable(fn):
        raise TypeError(f"dlspass.compile: fn must be callable, got {type(fn).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CompileError(
            f"optimizer: expected a torch.optim optimizer, got {type(optimizer).__name__}; "
            f"supported: {', '.join(SUPPORTED_OPTIMIZERS)}"
        )
    config = resolve_config(scaler, fp16_type, mixed_precision, max_gradient_norm)
    return CompiledStep(fn, optimizer, scaler, config, backend_compiler)
