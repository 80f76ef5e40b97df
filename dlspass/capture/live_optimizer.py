"""The optimizer of a ``dlspass.compile`` step: torch.optim's math from
``dlspass.capture.optim`` on the optimizer's live tensors, swapped in for ``optimizer.step`` /
``optimizer.zero_grad`` while the compiled step runs (see ``dlspass.capture.compiled_step``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dlspass import scale_policy
from dlspass.capture.fused_optimizer import (
    fused_constants,
    fused_group_update,
    fused_kernel_problem,
)
from dlspass.capture.optim import (
    SUPPORTED_OPTIMIZERS,
    FunctionalOptimizer,
    UnsupportedOptimizerError,
    functionalize,
    optimizer_kind,
    update_one,
)
from dlspass.capture.step_pipeline import StepCaptureError, param_targets
from dlspass.config import DLSConfig
from dlspass.graph import roles
from dlspass.graph.marks import mark

SUPPORTED_NAMES = ", ".join(f"torch.optim.{name}" for name in SUPPORTED_OPTIMIZERS)

def functionalize_live(optimizer: Any, names: dict[int, str]) -> FunctionalOptimizer:
    # the rule capture_step uses: torch.optim's classes and subclasses that keep their step
    if optimizer_kind(optimizer) is None:
        kind = type(optimizer)
        raise StepCaptureError(
            f"optimizer: {kind.__module__}.{kind.__qualname__} has no functional form in dlspass; "
            f"supported: {SUPPORTED_NAMES}"
        )
    try:
        return functionalize(optimizer, names)
    except (UnsupportedOptimizerError, ValueError) as e:
        raise StepCaptureError(f"optimizer: {e}") from e


def _materialize_state(optimizer: torch.optim.Optimizer, fopt: FunctionalOptimizer) -> dict[int, Tensor]:
    """Create the optimizer state torch would create lazily, so the graph can carry it.

    Returns the zero momentum buffers created for SGD by ``id(param)``: torch's first momentum
    buffer is the gradient itself, so such a buffer is marked uninitialised (see `LiveOptimizer`).
    """
    created: dict[int, Tensor] = {}
    for plan, group in zip(fopt.plans(), optimizer.param_groups, strict=True):
        keys = fopt.state_keys(plan)
        for p in group["params"]:
            st = optimizer.state[p]
            if fopt.kind == "SGD":
                if keys and st.get("momentum_buffer") is None:
                    st["momentum_buffer"] = created[id(p)] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
            elif any(k not in st for k in keys):
                # on the parameter's device, so the step count never needs a host round trip
                st.setdefault("step", torch.tensor(0.0, dtype=torch.float32, device=p.device))
                for k in keys[1:]:
                    if k not in st:
                        st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return created


def mark_static(tensors: Any) -> None:
    """Mark each tensor of ``tensors`` a static graph input (``torch._dynamo.mark_static_address``:
    its address is part of the compiled graph, guarded, so a replaced tensor recompiles)."""
    for t in tensors:
        if isinstance(t, Tensor):
            torch._dynamo.mark_static_address(t)


# ---- the traced step ---------------------------------------------------------------------------

class LiveOptimizer:
    """What the intercepted optimizer calls read while dynamo traces: plain attributes only.

    Built at the first call (so a model moved with ``.to()`` after ``dlspass.compile`` gets its
    state where it lives) and rebuilt before any call that finds the optimizer's structure
    changed or its state missing (``load_state_dict`` of a fresh checkpoint, a state reset).
    SGD's ``momentum_initialized`` flags live here, not in ``optimizer.state`` (torch keeps no
    such key): a zero buffer created by `_materialize_state` is uninitialised until the first
    step that is not skipped; a buffer that replaced it (``optimizer.load_state_dict``) is taken
    as initialised at the next call.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any, config: DLSConfig,
                 model: torch.nn.Module | None = None) -> None:
        self.optimizer = optimizer
        self.fopt: FunctionalOptimizer | None = None  # set by _build, at the first call
        self.scaler = scaler
        self.config = config
        self.model = model
        self.names = param_targets(optimizer, model)
        self.flags: dict[int, Tensor] = {}
        self._created: dict[int, tuple[Tensor, Tensor]] = {}  # id -> (param, zero buffer)
        self._signature: tuple | None = None
        self.params: list[list[Tensor]] = []
        self.param_names: list[list[str]] = []  # by position in self.params (set by _build)
        self.param_flags: list[list[Tensor | None]] = []
        self.state: Any = None
        # each group's fused-kernel constants (`fused_constants`), refreshed before each call:
        # the traced step reads these, never ``param_groups[gi]`` (dynamo guards every value of
        # a group dict it reads from, lr included, so a scheduler would recompile the step)
        self.constants: list[dict[str, float] | None] = []
        self._cuda = False  # set by _build: the parameters live on CUDA

    def _build(self) -> None:
        """(Re)read the optimizer's structure: groups, parameters, static options, lazy state."""
        opt = self.optimizer
        wrong = next((p for g in opt.param_groups for p in g["params"] if p.dtype != torch.float32), None)
        if wrong is not None:
            # the DLS math and the 16-bit lowering are written for float32 master weights; a
            # float64 model otherwise fails deep in the graph with a misleading message
            raise StepCaptureError(f"dlspass.compile: parameters must be float32 master weights, found "
                               f"{wrong.dtype} (shape {tuple(wrong.shape)}); call model.float() first")
        device = next((p.device for g in opt.param_groups for p in g["params"]), None)
        scaler = self.scaler
        if scaler is not None and device is not None and scaler.state.loss_scale.device != device:
            # the state must live beside the parameters: the step reads and writes it in-graph
            scaler.state = scale_policy.ScalerState(*(t.to(device) for t in scaler.state))
        if scaler is None and (self.state is None or self.state.loss_scale.device != device):
            self.state = scale_policy.init_state(self.config, device)
        self.names = param_targets(opt, self.model)
        self.fopt = functionalize_live(opt, self.names)  # parameters added since get names too
        self.plans = self.fopt.plans()
        self._signature = self.fopt.static_signature()
        created = _materialize_state(opt, self.fopt)
        for plan, group in zip(self.plans, opt.param_groups, strict=True):
            for p in group["params"]:
                if "momentum_initialized" in self.fopt.state_keys(plan):
                    if id(p) in created or id(p) not in self.flags:
                        self.flags[id(p)] = torch.tensor(id(p) not in created, device=p.device)
                if id(p) in created:
                    self._created[id(p)] = (p, created[id(p)])
        # every hyperparameter is a live float64 tensor (a graph input, refreshed before each
        # call), so a scheduler changing lr or weight decay never recompiles; only the plans'
        # static options (momentum on/off, nesterov, amsgrad, ...) are baked into the graph.
        # Shape (1,), viewed as 0-d in the graph: dynamo takes a 0-d float64 CPU input for a
        # Python float, fails to keep it symbolic and restarts the whole trace (twice the
        # dynamo + AOTAutograd time of the first call, and of every warm start).
        self.hyper = [{k: torch.zeros((1,), dtype=torch.float64, device=device)
                       for k in self.fopt.hyper_keys()} for _ in opt.param_groups]
        # the Python values last written into each hyperparameter tensor: a value that has not
        # changed since is not written again (each write is a kernel launch outside the graph,
        # five per step for AdamW, on a GPU)
        self._written: list[dict[str, float]] = [{} for _ in opt.param_groups]
        # the traced code reads these copies, never param_groups itself: dynamo guards every
        # value of a dict it iterates, so reading a group would bake its values in as constants
        self.params = [list(g["params"]) for g in opt.param_groups]
        # the traced code reads names and SGD's flags by position, never by ``id(param)``: a
        # dict keyed by ids is guarded on those ids, which a saved step
        # (``dlspass.capture.saved_step``) loaded in another process never matches
        self.param_names = [[self.names[id(p)] for p in ps] for ps in self.params]
        self.param_flags = [[self.flags.get(id(p)) for p in ps] for ps in self.params]
        self._cuda = device is not None and device.type == "cuda"
        if self._cuda:
            # inductor's cudagraph trees copy every graph input not marked static into the
            # recorded graph's own memory at each replay, and write nothing back: the state the
            # step updates in place must be read at its own address (torch.optim marks its
            # state the same way under torch.compile). On CPU nothing is recorded: unmarked.
            mark_static(t for group in self.hyper for t in group.values())
            mark_static(self.flags.values())
            mark_static(v for ps in self.params for p in ps for v in opt.state.get(p, {}).values())
            mark_static(self.scaler.state if scaler is not None else self.state)

    def _stale(self) -> bool:
        opt = self.optimizer
        if (self._signature is None or len(opt.param_groups) != len(self.params)
                or any(len(g["params"]) != len(ps) or any(a is not b for a, b in zip(g["params"], ps, strict=False))
                       for g, ps in zip(opt.param_groups, self.params, strict=True))
                or self.fopt.static_signature() != self._signature):
            return True
        keys = [self.fopt.state_keys(plan) for plan in self.plans]
        return any(k not in opt.state.get(p, ()) for ks, ps in zip(keys, self.params, strict=True)
                   for p in ps for k in ks if k != "momentum_initialized")

    def refresh(self) -> None:
        """Before each call: (re)build when the optimizer's structure changed or its state is
        missing (the call then may recompile), pick up loaded momentum, and write the current
        hyperparameters into their tensors."""
        opt = self.optimizer
        if self._stale():
            self._build()
        for pid, (p, buf) in list(self._created.items()):
            if opt.state[p].get("momentum_buffer") is not buf:  # replaced, e.g. by load_state_dict
                self.flags[pid].fill_(True)
                del self._created[pid]
        for hyper, written, group in zip(self.hyper, self._written, opt.param_groups, strict=True):
            values = dict(group)
            if self.fopt.kind == "Adam":
                values["beta1"], values["beta2"] = group["betas"]
            for k, t in hyper.items():
                v = values[k]
                if isinstance(v, Tensor):
                    t.copy_(v.detach().reshape(()))  # no host sync for a tensor lr
                    written.pop(k, None)
                elif written.get(k) != float(v):  # NaN never equals: written every call
                    t.fill_(float(v))
                    written[k] = float(v)
        self.constants = [fused_constants(g) if fused_kernel_problem(
            self.fopt.kind, plan, ps[0].device.type if ps else "cpu") is None else None
            for g, plan, ps in zip(opt.param_groups, self.plans, self.params, strict=True)]
        if self.scaler is not None:
            if self._cuda and self.scaler.state is not self.state:  # a loaded or moved state
                mark_static(self.scaler.state)
            self.state = self.scaler.state

    def step(self, *args: Any, **kwargs: Any) -> None:
        """The optimizer step as a plain functional update, every value marked with its role.

        Traced by dynamo in place of ``optimizer.step``; ``apply_dls`` adds DLS afterwards.
        """
        if args or kwargs:
            raise StepCaptureError("optimizer.step(closure) is not supported inside dlspass.compile")
        with torch.no_grad():
            for gi, (params, plan) in enumerate(zip(self.params, self.plans, strict=True)):
                constants = self.constants[gi]  # None: not the fused kernel's group (`refresh`)
                if constants is not None:
                    self._fused_step(gi, params, plan, constants)
                    continue
                hyper = {k: mark(t, roles.HYPER, f"group{gi}.{k}").reshape(())
                         for k, t in self.hyper[gi].items()}
                for p, name, flag in zip(params, self.param_names[gi], self.param_flags[gi], strict=True):
                    if p.grad is None:
                        continue
                    g = mark(p.grad, roles.GRAD, name)
                    old = mark(p, roles.PARAM, name)
                    live = self._state_of(p, plan, flag)
                    st = {k: mark(v, roles.OPT_STATE, f"{name}.{k}") for k, v in live.items()}
                    new_p, new_st = update_one(self.fopt.kind, plan, old, g.to(p.dtype), st, hyper)
                    p.copy_(mark(new_p, roles.PARAM_UPDATE, name))
                    for k, v in new_st.items():
                        live[k].copy_(mark(v, roles.OPT_STATE_UPDATE, f"{name}.{k}"))
            if not self.config.enabled:
                return
            for t, field in zip(self.state, scale_policy.STATE_FIELDS, strict=True):
                # the state passes through; UpdateScalePass replaces these outputs
                t.copy_(mark(mark(t, roles.SCALER_STATE, field), roles.SCALER_STATE_UPDATE, field))

    def _fused_step(self, gi: int, params: list[Tensor], plan: Any, constants: dict[str, float]) -> None:
        """Group ``gi``'s update by torch's fused kernel (``dlspass.capture.fused_optimizer``'s
        policy), its values marked as `step`'s are."""
        # by position, as `step` reads them (a saved step runs in another process: no ids)
        pairs = [(p, n) for p, n in zip(params, self.param_names[gi], strict=True) if p.grad is not None]
        if not pairs:
            return  # no gradient in the group: torch.optim skips every parameter of it
        lr = mark(self.hyper[gi]["lr"], roles.HYPER, f"group{gi}.lr").reshape(())
        live, names = [p for p, _ in pairs], [n for _, n in pairs]
        states = [self._state_of(p, plan, None) for p in live]
        new_ps, new_sts = fused_group_update(
            plan, [mark(p, roles.PARAM, n) for p, n in zip(live, names, strict=True)],
            [mark(p.grad, roles.GRAD, n).to(p.dtype) for p, n in zip(live, names, strict=True)],
            [{k: mark(v, roles.OPT_STATE, f"{n}.{k}") for k, v in st.items()}
             for st, n in zip(states, names, strict=True)], lr, constants)
        for p, n, st, new_p, new_st in zip(live, names, states, new_ps, new_sts, strict=True):
            p.copy_(mark(new_p, roles.PARAM_UPDATE, n))
            for k, v in new_st.items():
                st[k].copy_(mark(v, roles.OPT_STATE_UPDATE, f"{n}.{k}"))

    def _state_of(self, p: Tensor, plan: Any, flag: Tensor | None) -> dict[str, Tensor]:
        """The live state tensors ``update_one`` reads for ``p``, in torch's ``optimizer.state``
        except SGD's ``momentum_initialized`` flag (``flag``), which torch does not keep."""
        st = self.optimizer.state[p]
        return {k: (flag if k == "momentum_initialized" else st[k])
                for k in self.fopt.state_keys(plan)}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for params in self.params:
            for p in params:
                p.grad = None
