"""In-graph numerics telemetry (``DLSConfig(telemetry=True)``, or a `Telemetry` in a step's
``graph_passes``): the hook lives with the step front ends that run it
(``dlspass.capture.telemetry``); it is named here too, with the other debugging tools."""

from __future__ import annotations

from dlspass.capture.telemetry import Telemetry

__all__ = ["Telemetry"]
