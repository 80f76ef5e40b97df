"""Long fault-injection run: 10,000 steps of random inf/NaN faults, eager and captured.

Per mode it checks, at every step, that no parameter or optimizer-state value is non-finite
and that a step was skipped exactly when a fault fired; at the end, that the parameters and
optimizer state are bit-identical to a fault-free run that does not step on the faulted batches
(fp32 and power-of-two loss scales make this exact). Prints a JSON summary.

    .venv/bin/python tools/reliability/long_faults.py --steps 10000 --rate 0.05
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import dlspass
from dlspass.debug.faults import EagerFaultInjector, install_faults, random_faults
from dlspass.models import MLP, mse_loss

GRADS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
CHUNK = 1000  # captured mode injects one chunk's faults at a time (graph size stays small)


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + k)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def fresh() -> tuple[MLP, torch.optim.Adam]:
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        out += [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return out


def finite(ts: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def run_eager(steps: int, faults: list, interval: int) -> dict:
    model, opt = fresh()
    scaler = dlspass.GradScaler(steps_per_increase=interval, on_scale_floor="warn")
    skipped, nonfinite_steps = set(), 0
    with EagerFaultInjector(model, faults) as inj:
        for k in range(steps):
            inj.step = k
            opt.zero_grad(set_to_none=True)
            scaler.scale(inj.loss(mse_loss(model, batch(k)))).backward()
            if not bool(scaler.step(opt)):
                skipped.add(k)
            scaler.update()
            nonfinite_steps += not finite(tensors(model, opt))
    ref_model, ref_opt = fresh()
    for k in range(steps):
        if k not in skipped:
            ref_opt.zero_grad(set_to_none=True)
            mse_loss(ref_model, batch(k)).backward()
            ref_opt.step()
    return {"skipped": skipped, "nonfinite_steps": nonfinite_steps,
            "fired": {f.step for f in inj.fired},
            "bit_identical": identical(tensors(model, opt), tensors(ref_model, ref_opt)),
            "final_scale": float(scaler.get_scale())}


def run_captured(steps: int, faults: list, activations: list[str] | None, interval: int) -> dict:
    cfg = dlspass.DLSConfig(mixed_precision=False, steps_per_increase=interval)
    model, opt = fresh()
    step = dlspass.capture_step(model, mse_loss, opt, batch(0), config=cfg)
    skipped, nonfinite_steps = set(), 0
    for start in range(0, steps, CHUNK):
        chunk = [f for f in faults if start <= f.step < start + CHUNK]
        schedule = install_faults(step, chunk)
        for k in range(start, min(start + CHUNK, steps)):
            n0 = int(step.scaler.state.num_skipped_steps)
            step(batch(k))
            if int(step.scaler.state.num_skipped_steps) > n0:
                skipped.add(k)
            nonfinite_steps += not finite(tensors(model, opt))
        schedule.remove()
    ref_model, ref_opt = fresh()
    ref = dlspass.capture_step(ref_model, mse_loss, ref_opt, batch(0), config=cfg)
    for k in range(steps):
        if k not in skipped:
            ref(batch(k))
    return {"skipped": skipped, "nonfinite_steps": nonfinite_steps,
            "fired": {f.step for f in faults},
            "bit_identical": identical(tensors(model, opt), tensors(ref_model, ref_opt)),
            "final_scale": float(step.scaler.get_scale())}


def captured_activation_nodes() -> list[str]:
    model, opt = fresh()
    step = dlspass.capture_step(model, mse_loss, opt, batch(0),
                                config=dlspass.DLSConfig(mixed_precision=False))
    out = []
    for n in step.graph_module.graph.nodes:
        if dlspass.graph.roles.role_of(n) == "loss":
            break
        if n.op == "call_function" and n.target in (torch.ops.aten.addmm.default,
                                                     torch.ops.aten.relu.default):
            out.append(n.name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=0.05, help="probability that a step is faulted")
    ap.add_argument("--steps-per-increase", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="eager,captured")
    ap.add_argument("--out", help="also write the JSON summary here")
    a = ap.parse_args(argv)
    import warnings

    warnings.simplefilter("ignore", dlspass.ScaleFloorWarning)
    summary: dict = {"steps": a.steps, "rate": a.rate, "seed": a.seed, "modes": {}}
    ok = True
    for mode in a.modes.split(","):
        t0 = time.monotonic()
        if mode == "eager":
            faults = random_faults(a.steps, a.rate, grads=GRADS, activations=["fc1", "fc2", "fc3"],
                                   seed=a.seed)
            r = run_eager(a.steps, faults, a.steps_per_increase)
        elif mode == "captured":
            faults = random_faults(a.steps, a.rate, grads=GRADS,
                                   activations=captured_activation_nodes(), seed=a.seed + 1)
            r = run_captured(a.steps, faults, None, a.steps_per_increase)
        else:
            ap.error(f"unknown mode {mode!r}")
        kinds: dict[str, int] = {}
        for f in faults:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        res = {"faults_injected": len(faults), "by_kind": kinds,
               "faulted_steps": len({f.step for f in faults}), "steps_skipped": len(r["skipped"]),
               "every_faulted_step_skipped": r["skipped"] == {f.step for f in faults},
               "nonfinite_param_or_state_steps": r["nonfinite_steps"],
               "clean_steps_bit_identical_to_reference": r["bit_identical"],
               "final_scale": r["final_scale"], "seconds": round(time.monotonic() - t0, 1)}
        ok &= (res["every_faulted_step_skipped"] and res["nonfinite_param_or_state_steps"] == 0
               and res["clean_steps_bit_identical_to_reference"])
        summary["modes"][mode] = res
        print(json.dumps({mode: res}), file=sys.stderr, flush=True)
    summary["ok"] = bool(ok)
    text = json.dumps(summary, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
