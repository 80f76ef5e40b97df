"""One process of tests/test_cache_facts.py: compile a tiny DLS step with inductor, train a few
steps (one of them overflowing), and save what the step did and what torch's caches counted.

Run as ``python tests/cache_child.py OUT.pt [save|load ARTIFACTS]`` (``save``: write the
mega-cache after training; ``load``: load it before compiling); the CPU facts (``ATEN_CPU_CAPABILITY``,
``OMP_NUM_THREADS``) and ``TORCHINDUCTOR_CACHE_DIR`` come from the environment, which is the
point: each process is one machine kind sharing one cache folder.
"""

from __future__ import annotations

import sys

import torch
from torch._dynamo.utils import counters

import dlspass
from dlspass.cache_facts import cpu_facts, load_cache_artifacts, save_cache_artifacts
from dlspass.models import MLP, mse_train_step

OVERFLOW_STEP = 1  # the second of three steps overflows: a skip, then a clean step after it


def main(out: str, mega: str = "", artifacts: str = "") -> None:
    if mega == "load":
        load_cache_artifacts(artifacts)
    torch.manual_seed(0)
    # widths of 32 and 64: whole vectors at 256 and at 512 bits, so each ISA's vector code runs
    model = MLP(d_in=32, d_hidden=64, d_out=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10, steps_per_increase=2)
    step = dlspass.compile(mse_train_step(model, opt), optimizer=opt, scaler=scaler,
                           fp16_type="float16")
    g = torch.Generator().manual_seed(1)
    record: dict[str, list] = {"loss": [], "found_inf": [], "scale": []}
    for i in range(3):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        if i == OVERFLOW_STEP:
            x[0, 0] = float("inf")
        record["loss"].append(step(x, y))
        record["found_inf"].append(scaler.found_inf.clone())
        record["scale"].append(scaler.state.loss_scale.clone())
    torch.save({**record, "params": [p.detach().clone() for p in model.parameters()],
                "skipped": scaler.state.num_skipped_steps.clone(), "facts": cpu_facts(),
                "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
                "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"]}, out)
    if mega == "save":
        save_cache_artifacts(artifacts)


if __name__ == "__main__":
    main(*sys.argv[1:])
