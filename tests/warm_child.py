"""One process of tests/test_warm_start.py: compile a tiny DLS step with ``dlspass.compile``,
train six steps (the second overflowing) and save what the step did and what torch's caches
counted.

Run as ``python tests/warm_child.py OUT.pt VARIANT [save|load ARTIFACTS]``. ``VARIANT`` names
the plan (`PLANS`): the same model, optimizer and data under another DLS config must be a cache
miss. ``save`` writes the mega-cache after training, ``load`` loads it before compiling.
``TORCHINDUCTOR_CACHE_DIR`` comes from the environment: processes sharing it share the caches.
"""

from __future__ import annotations

import sys
import time

import torch
from torch._dynamo.utils import counters

import dlspass
from dlspass.cache_facts import load_cache_artifacts, save_cache_artifacts
from dlspass.models import MLP, mse_train_step

OVERFLOW_STEP = 1  # the second of six steps overflows: a skip, then clean steps after it
STEPS = 6

# the scaler's keyword arguments per variant: each differs from "base" in what the dlspass
# passes do (the format, the scale policy's growth, the scale rule), not in the traced graph
PLANS: dict[str, dict] = {
    "base": {"loss_scale": "dynamic", "init_scale": 2.0**10, "steps_per_increase": 2,
             "fp16_type": "float16"},
    "bfloat16": {"loss_scale": "dynamic", "init_scale": 2.0**10, "steps_per_increase": 2,
                 "fp16_type": "bfloat16"},
    "growth": {"loss_scale": "dynamic", "init_scale": 2.0**10, "steps_per_increase": 3,
               "fp16_type": "float16"},
    "static": {"loss_scale": 2.0**10, "fp16_type": "float16"},
}


def main(out: str, variant: str, mega: str = "", artifacts: str = "") -> None:
    if mega == "load":
        load_cache_artifacts(artifacts)
    torch.manual_seed(0)
    model = MLP(d_in=32, d_hidden=64, d_out=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = dlspass.GradScaler(**PLANS[variant])
    step = dlspass.compile(mse_train_step(model, opt), optimizer=opt, scaler=scaler)
    g = torch.Generator().manual_seed(1)
    record: dict[str, list] = {"loss": [], "found_inf": [], "scale": []}
    first_call_s = 0.0
    for i in range(STEPS):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        if i == OVERFLOW_STEP:
            x[0, 0] = float("inf")
        start = time.perf_counter()
        record["loss"].append(step(x, y))
        if i == 0:
            first_call_s = time.perf_counter() - start
        record["found_inf"].append(scaler.found_inf.clone())
        record["scale"].append(scaler.state.loss_scale.clone())
    counts = {f"{group}.{name}": counters[group][name]
              for group, name in (("aot_autograd", "autograd_cache_hit"),
                                  ("aot_autograd", "autograd_cache_miss"),
                                  ("aot_autograd", "autograd_cache_bypass"),
                                  ("inductor", "fxgraph_cache_hit"),
                                  ("inductor", "fxgraph_cache_miss"))}
    torch.save({**record, "params": [p.detach().clone() for p in model.parameters()],
                "skipped": scaler.state.num_skipped_steps.clone(), "counts": counts,
                "first_call_s": first_call_s, "n_graphs": len(step.graphs)}, out)
    if mega == "save":
        save_cache_artifacts(artifacts)


if __name__ == "__main__":
    main(*sys.argv[1:])
