"""Every name in ``dlspass.__all__`` stays what the docs say it is after every public function ran.

A submodule that shares its name with a public verb replaces the verb on first import (the
import system sets ``dlspass.<submodule>``): ``dlspass.verify`` became a module after
``capture_step`` imported the verifier. The check runs in a fresh interpreter, so no earlier
test has imported anything first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import dlspass

# what dlspass/__init__.py's docstring and README document for each public name
CLASSES = {
    "ConfigError", "DLSConfig", "DLSInputError", "DLSInternalError", "DLSPassError", "GradScaler",
    "TorchGradScaler", "HeldScheduler", "ScaleFloorWarning", "ScaleFloorError", "ScalerState",
    "CapturedStep", "CaptureError", "CompileError", "StepCaptureError", "VerificationError",
    "ScalerStateError",
}
FUNCTIONS = {
    "hold_scheduler_on_skip", "round_to_format", "capture_step", "capture_step_distributed",
    "verify", "compile", "make_backend", "analyze",
}
MODULES = {"formats"}

SCRIPT = textwrap.dedent('''
    import inspect, os, pkgutil, sys, types
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import dlspass
    from dlspass.models import MLP, mse_loss, mse_train_step

    classes, functions, modules = {classes!r}, {functions!r}, {modules!r}

    def kind(v):
        if isinstance(v, types.ModuleType):
            return "module"
        return "class" if inspect.isclass(v) else "function" if inspect.isfunction(v) else type(v).__name__

    def check(when):
        for name in dlspass.__all__:
            want = "class" if name in classes else "function" if name in functions else "module"
            got = kind(getattr(dlspass, name))
            assert got == want, f"{{when}}: dlspass.{{name}} is a {{got}}, the docs say a {{want}}"

    assert set(dlspass.__all__) == classes | functions | modules, sorted(dlspass.__all__)
    check("at import")
    before = {{name: getattr(dlspass, name) for name in dlspass.__all__}}
    submodules = {{m.name for m in pkgutil.iter_modules(dlspass.__path__)}}
    clash = (set(dlspass.__all__) - modules) & submodules
    assert not clash, f"public names shared with a submodule: {{sorted(clash)}}"

    torch.manual_seed(0)
    batch = (torch.randn(4, 8), torch.randn(4, 4))

    def fresh():
        model = MLP()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    # eager scalers and the scheduler hold
    for cls in (dlspass.GradScaler, dlspass.TorchGradScaler):
        model, opt = fresh()
        scaler = cls()
        sched = dlspass.hold_scheduler_on_skip(torch.optim.lr_scheduler.StepLR(opt, 1), scaler)
        scaler.scale(mse_loss(model, batch)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    dlspass.round_to_format(torch.randn(3), "cbfloat16")
    dlspass.formats.round_bits(torch.randn(3), "bfloat16")

    # capture_step (imports the verifier), then verify its graph
    model, opt = fresh()
    cfg = dlspass.DLSConfig(fp16_type="cbfloat16")
    step = dlspass.capture_step(model, mse_loss, opt, batch, config=cfg)
    step(batch)
    dlspass.verify(step.graph_module)

    # capture_step_distributed on a one-rank gloo group
    dist.init_process_group("gloo", init_method="file://" + os.path.join(sys.argv[1], "store"),
                            rank=0, world_size=1)
    try:
        model, opt = fresh()
        dlspass.capture_step_distributed(model, mse_loss, opt, batch, cfg)(batch)
    finally:
        dist.destroy_process_group()

    # dlspass.compile and make_backend, without inductor (fast)
    model, opt = fresh()

    train_step = mse_train_step(model, opt)

    dlspass.compile(train_step, optimizer=opt, scaler=dlspass.GradScaler(),
                    backend_compiler="eager")(*batch)
    model, opt = fresh()
    scaler = dlspass.GradScaler()
    backend = dlspass.make_backend(scaler=scaler, backend_compiler="eager")
    F.mse_loss(torch.compile(model, backend=backend)(batch[0]), batch[1]).backward()
    scaler.step(opt)
    scaler.update()
    F.mse_loss(torch.compile(MLP(), backend="dlspass",
                             options={{"backend_compiler": "eager"}})(batch[0]), batch[1]).backward()

    check("after every public function ran")
    for name, value in before.items():
        assert getattr(dlspass, name) is value, f"dlspass.{{name}} changed after the calls"
    print("public names OK")
''').format(classes=CLASSES, functions=FUNCTIONS, modules=MODULES)


def test_public_names_keep_their_kind_after_every_public_function(tmp_path):
    assert set(dlspass.__all__) == CLASSES | FUNCTIONS | MODULES
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "public names OK" in proc.stdout
