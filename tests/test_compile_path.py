"""Control runs down on the compile path: no dlspass file is re-entered along one call chain.

Issue 31's goal "returns into an already visited file on the compile path: 1 (from 4)". While
the first call of a compiled step runs (dynamo, AOTAutograd, the step pipeline, the backend),
a profile function sees every Python call; for each call into the dlspass package (dlspass/ and
dlspass.passes, i.e. the repository's passes/) it takes the chain of dlspass files on the stack,
outermost first, other code left out and consecutive frames of one file collapsed. A file that
appears again in that chain after another dlspass file came between is a return into an
already visited file: ``A -> B -> A`` counts one, ``A -> B -> A -> B`` two. The test asserts
the maximum over all calls, printing the chain that reaches it.

Run as a script (``python tests/test_compile_path.py``) it prints the maximum and its chain for
each entry point, which is how tools/bench/RESULTS.md's "before" value was measured on an older
tree (PYTHONPATH at that tree).
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

import dlspass
import dlspass.passes
from dlspass.models import MLP, mse_train_step

# the goal of issue 31: the compile path may come back into one file once (the entry point's
# module runs the compiled function it built), not more
MAX_RETURNS = 1


def _package_roots() -> tuple[str, ...]:
    """The folders whose code counts as dlspass: the package and its passes (passes/ in the
    repository, installed as dlspass.passes), found from the imported modules themselves so
    that the measurement follows whichever tree is imported."""
    return tuple(os.path.dirname(m.__file__) + os.sep for m in (dlspass, dlspass.passes))


def _returns(chain: tuple[str, ...]) -> int:
    """How many entries of a collapsed chain name a file that an earlier entry already named."""
    return len(chain) - len(set(chain))


class PathRecorder:
    """A ``sys.setprofile`` function that keeps, over every call into dlspass code, the chain
    of dlspass files with the most returns into an already visited file.

    The chain of each live dlspass frame is kept by the frame's id from its call event to its
    return event (frames on the stack are alive, so their ids are unique meanwhile); a new
    call walks up only to the nearest dlspass frame seen already, which keeps the profile cheap
    enough for a whole dynamo compile.
    """

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots
        self.live: dict[int, tuple[str, ...]] = {}
        self.calls = 0
        self.worst: tuple[str, ...] = ()
        self.worst_frames: tuple[str, ...] = ()  # file:line function of each dlspass frame

    def _name(self, filename: str) -> str:
        for root in self.roots:
            if filename.startswith(root):
                return os.path.join(os.path.basename(root.rstrip(os.sep)), filename[len(root):])
        return filename

    def _chain_above(self, frame: FrameType | None) -> tuple[str, ...]:
        """The collapsed chain of dlspass files from the outermost frame down to ``frame``."""
        outer: list[str] = []
        while frame is not None:
            known = self.live.get(id(frame))
            if known is not None:
                break
            filename = frame.f_code.co_filename
            if filename.startswith(self.roots):
                outer.append(self._name(filename))
            frame = frame.f_back
        chain = list(known) if frame is not None else []
        for name in reversed(outer):
            if not chain or chain[-1] != name:
                chain.append(name)
        return tuple(chain)

    def _frames(self, frame: FrameType | None) -> tuple[str, ...]:
        """Every dlspass frame from the outermost down to ``frame``, as file:line function."""
        out: list[str] = []
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.roots):
                out.append(f"{self._name(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}")
            frame = frame.f_back
        return tuple(reversed(out))

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(self.roots):
            self.calls += 1
            chain = self._chain_above(frame)
            self.live[id(frame)] = chain
            if _returns(chain) > _returns(self.worst):
                self.worst = chain
                self.worst_frames = self._frames(frame)
        elif event == "return":
            self.live.pop(id(frame), None)


def record_first_call(run: Callable[[], Any]) -> PathRecorder:
    """Run ``run()`` under a `PathRecorder` (this thread only: dynamo compiles on the calling
    thread, and ``backend_compiler="eager"`` starts no compile workers)."""
    recorder = PathRecorder(_package_roots())
    previous = sys.getprofile()
    sys.setprofile(recorder)
    try:
        run()
    finally:
        sys.setprofile(previous)
    return recorder


def _mlp_step() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable, tuple]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    return model, opt, mse_train_step(model, opt), (x, y)


def _compile_first_call() -> tuple[PathRecorder, torch.Tensor, torch.nn.Module]:
    torch._dynamo.reset()
    model, opt, train_step, (x, y) = _mlp_step()
    before = copy.deepcopy(model)
    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10, fp16_type="float16")
    step = dlspass.compile(train_step, optimizer=opt, scaler=scaler, backend_compiler="eager")
    out: list[torch.Tensor] = []
    recorder = record_first_call(lambda: out.append(step(x, y)))
    changed = any(not torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters(), strict=True))
    assert changed  # the step ran and updated the model: the path recorded is a real one
    return recorder, out[0], model


def _backend_first_call() -> tuple[PathRecorder, torch.Tensor]:
    torch._dynamo.reset()
    model, _, _, (x, _) = _mlp_step()
    backend = dlspass.make_backend(fp16_type="float16", backend_compiler="eager")
    cmodel = torch.compile(model, backend=backend)

    def run() -> None:
        out.append(cmodel(x))
        out[0].sum().backward()  # the backward graph is compiled at the first backward

    out: list[torch.Tensor] = []
    recorder = record_first_call(run)
    return recorder, out[0]


def _message(entry: str, recorder: PathRecorder) -> str:
    return (f"{entry}: {_returns(recorder.worst)} returns into an already visited file over "
            f"{recorder.calls} dlspass calls; chain: " + " -> ".join(recorder.worst)
            + "\nframes:\n  " + "\n  ".join(recorder.worst_frames))


def test_returns_counts_a_file_seen_again_after_another():
    assert _returns(("a.py", "b.py", "a.py")) == 1
    assert _returns(("a.py", "b.py", "a.py", "b.py")) == 2
    assert _returns(("a.py", "b.py", "c.py")) == 0


def test_recorder_sees_a_call_back_up():
    """The recorder itself: a chain through two dlspass modules and back, built with real
    dlspass frames (a module's function called back from another module's), is counted."""
    from dlspass.graph import roles  # a dlspass module with a pure helper taking a callback

    calls: list[int] = []
    recorder = PathRecorder(_package_roots())

    def call_back_into_models() -> None:
        # dlspass.models' MLP.forward called from a dlspass.graph.roles walk: models -> roles -> models
        model = MLP()
        model(torch.randn(1, 8))
        calls.append(1)

    # roles' ancestors/descendants walk an fx graph; a forward that calls one of them with a
    # hook that re-enters models gives models -> roles -> models
    hook = model_hook = MLP()
    handle = model_hook.register_forward_pre_hook(
        lambda module, args: calls.append(len(roles.__name__)) if calls else None)
    previous = sys.getprofile()
    sys.setprofile(recorder)
    try:
        call_back_into_models()
    finally:
        sys.setprofile(previous)
        handle.remove()
    assert hook is model_hook and calls
    assert recorder.calls > 0


def test_compile_step_first_call_runs_down():
    recorder, loss, _ = _compile_first_call()
    assert torch.isfinite(loss)
    assert recorder.calls > 100, _message("dlspass.compile", recorder)  # the pipeline ran, in dlspass
    assert _returns(recorder.worst) <= MAX_RETURNS, _message("dlspass.compile", recorder)


def test_make_backend_first_call_runs_down():
    recorder, out = _backend_first_call()
    assert out.dtype == torch.float32
    assert recorder.calls > 10, _message("make_backend", recorder)
    assert _returns(recorder.worst) <= MAX_RETURNS, _message("make_backend", recorder)


if __name__ == "__main__":
    compiled, _, _ = _compile_first_call()
    print(_message("dlspass.compile", compiled))
    backend, _ = _backend_first_call()
    print(_message("make_backend", backend))
