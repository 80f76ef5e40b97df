"""`StepRunner`: what the captured step (``capture_step``) and the compiled step
(``dlspass.compile``) have in common around the one step pipeline.

Both run a `StepPlan`'s graph and show the same attributes: ``plan``, ``config``, ``scaler``,
the hooks ``graph_passes`` and ``extra_inputs`` (the plan's own list and dict, so a change
reaches the next build), ``telemetry``, ``num_calls``, ``graph_targets`` and, after each call
that scales, the scaler's bookkeeping (``found_inf``, ``stepped()``, the scale log).
"""

from __future__ import annotations

from typing import Any

import torch

from dlspass.capture.step_pipeline import graph_targets
from dlspass.capture.step_plan import StepPlan


class StepRunner:
    """The base of `CapturedStep` and `CompiledStep` (module docstring)."""

    def __init__(self, plan: StepPlan, optimizer: torch.optim.Optimizer) -> None:
        self.plan = plan
        self.optimizer = optimizer
        self.config = plan.config
        self.scaler = plan.scaler
        self.graph_passes = plan.graph_passes
        self.extra_inputs = plan.extra_inputs
        self.telemetry = plan.telemetry
        self.num_calls = 0

    def _param_names(self) -> dict[int, str]:
        """``{id(param): graph target}`` for the parameters the graph names."""
        raise NotImplementedError

    def graph_targets(self, model: torch.nn.Module | None = None) -> dict[str, str]:
        """``{name: GRAD/PARAM target in the graph}`` for the optimizer's parameters.

        Graph targets are the names of the step's ``model`` for its parameters and
        ``group{i}.param{j}`` otherwise (``param_targets``); with ``model`` the keys are the
        model's parameter names (``fc1.weight``), for parameters the graph names.
        """
        return graph_targets(self._param_names(), model)

    def _scales(self) -> bool:
        """True when the step scales (the scaler's bookkeeping follows every call)."""
        return self.config is not None and self.config.enabled and self.scaler is not None

    def _record(self, skipped_before: Any) -> None:
        """The scaler's bookkeeping after a call (``skipped_before``: its skip count before)."""
        if self._scales():
            self.scaler.record_compiled_step(skipped_before, self.optimizer)
