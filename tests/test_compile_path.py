"""Control runs down on the compile path: how often a call chain comes back into a dlspass file.

Issue 31's goal "returns into an already visited file on the compile path: 1 (from 4)". While
the first call of a compiled step runs (dynamo, AOTAutograd, the step pipeline, the backend),
a profile function sees every Python call; for each call into the dlspass package (dlspass/ and
dlspass.passes, i.e. the repository's passes/) it takes the chain of dlspass files on the stack,
outermost first, other code left out and consecutive frames of one file collapsed. A file that
appears again in that chain after another dlspass file came between is a return into an
already visited file: ``A -> B -> A`` counts one, ``A -> B -> A -> B`` two. The tests take
the maximum over all calls, and the same with dlspass.passes left out (the capture layer's own
hand-offs), and print the chain that reaches it when they fail.

Run as a script (``python tests/test_compile_path.py``) it prints both maxima and their chains
for each entry point; tools/bench/RESULTS.md's "before" values were measured so on 786b5dd, with
that tree's ``dlspass`` and ``passes/`` (as ``dlspass.passes``) imported instead of this one's.
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

# issue 31's goal: along any one call chain, at most one return into an already visited file
MAX_RETURNS = 1


PASSES_DIR = "passes" + os.sep  # how `PathRecorder` names a file of dlspass.passes


def _package_roots() -> tuple[str, ...]:
    """The folders whose code counts as dlspass: the package and its passes (passes/ in the
    repository, installed as dlspass.passes), found from the imported modules themselves so
    that the measurement follows whichever tree is imported."""
    return tuple(os.path.dirname(m.__file__) + os.sep for m in (dlspass, dlspass.passes))


def _returns(chain: tuple[str, ...]) -> int:
    """How many entries of a collapsed chain name a file that an earlier entry already named."""
    return len(chain) - len(set(chain))


def _without_passes(chain: tuple[str, ...]) -> tuple[str, ...]:
    """``chain`` without the files of dlspass.passes, consecutive equal files collapsed again."""
    out: list[str] = []
    for name in chain:
        if not name.startswith(PASSES_DIR) and (not out or out[-1] != name):
            out.append(name)
    return tuple(out)


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
        # the same measure with the passes left out: the capture layer's own hand-offs
        self.worst_above_passes: tuple[str, ...] = ()
        self.worst_above_frames: tuple[str, ...] = ()

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
            above = _without_passes(chain)
            if _returns(above) > _returns(self.worst_above_passes):
                self.worst_above_passes = above
                self.worst_above_frames = self._frames(frame)
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
    scaler = dlspass.GradScaler(loss_scale="dynamic", init_scale=2.0**10, fp16_type="float16")
    backend = dlspass.make_backend(scaler=scaler, backend_compiler="eager")
    cmodel = torch.compile(model, backend=backend)

    def run() -> None:
        out.append(cmodel(x))
        out[0].sum().backward()  # the backward graph is compiled and run at the first backward

    out: list[torch.Tensor] = []
    recorder = record_first_call(run)
    assert len(backend.graphs) == 2  # the forward and the backward graph went through the rewrites
    # the backward ran the scaling: its finite flag reached the scaler
    assert scaler.backend_found_finite is not None and bool(scaler.backend_found_finite)
    return recorder, out[0]


def _message(entry: str, recorder: PathRecorder) -> str:
    return (f"{entry}: {_returns(recorder.worst)} returns into an already visited file over "
            f"{recorder.calls} dlspass calls; chain: " + " -> ".join(recorder.worst)
            + "\nframes:\n  " + "\n  ".join(recorder.worst_frames)
            + f"\nwithout dlspass.passes: {_returns(recorder.worst_above_passes)}; chain: "
            + " -> ".join(recorder.worst_above_passes)
            + "\nframes:\n  " + "\n  ".join(recorder.worst_above_frames))


def test_returns_counts_a_file_seen_again_after_another():
    assert _returns(("probe_a.py", "probe_b.py", "probe_a.py")) == 1
    assert _returns(("probe_a.py", "probe_b.py", "probe_a.py", "probe_b.py")) == 2
    assert _returns(("probe_a.py", "probe_b.py", "c.py")) == 0


def test_recorder_counts_a_call_back_up(tmp_path, monkeypatch):
    """The recorder on two modules of its own: ``probe_a.down`` calls ``probe_b.walk``, which
    calls back ``probe_a.leaf`` (a -> b -> a: one return) through ``probe_b.inner`` (the same
    file as ``walk``: collapsed)."""
    (tmp_path / "probe_a.py").write_text(
        "import probe_b\n\ndef down():\n    return probe_b.walk(leaf)\n\ndef leaf():\n    return 1\n")
    (tmp_path / "probe_b.py").write_text(
        "def walk(cb):\n    return inner(cb)\n\ndef inner(cb):\n    return cb()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import probe_a  # the files written above

    recorder = PathRecorder((str(tmp_path) + os.sep,))
    previous = sys.getprofile()
    sys.setprofile(recorder)
    try:
        assert probe_a.down() == 1
    finally:
        sys.setprofile(previous)
    name = os.path.basename(str(tmp_path))
    assert recorder.calls == 4  # down, walk, inner, leaf
    assert recorder.worst == (f"{name}/probe_a.py", f"{name}/probe_b.py", f"{name}/probe_a.py")
    assert recorder.worst_frames[-1].endswith(" leaf")
    assert _returns(recorder.worst) == 1


# Issue 31's goal: 1 (from 4 on 786b5dd; tools/bench/RESULTS.md "Control runs down"). The
# capture layer runs down (compiled_step -> aot -> step_pipeline -> passes/__init__; 786b5dd had
# compiled_step -> dynamo_backend -> compiled_step). The one return left is a pass calling a
# helper of the template's module (passes/base.py -> a pass's file -> passes/base.py); the
# template decides whether a pass runs before asking for its preconditions
# (``DLSPass.requires``), so no hook calls back into the template.
COMPILE_RETURNS = 1


def test_compile_step_first_call_runs_down():
    recorder, loss, _ = _compile_first_call()
    assert torch.isfinite(loss)
    message = _message("dlspass.compile", recorder)
    assert recorder.calls > 100, message  # the pipeline ran, in dlspass
    assert _returns(recorder.worst_above_passes) == 0, message
    assert _returns(recorder.worst) <= COMPILE_RETURNS, message


def test_make_backend_first_call_runs_down():
    """make_backend(scaler=...): dynamo_backend hands its config to aot.lowering_backend, which
    makes the rewrites itself (before, aot called back into dynamo_backend's rewrites)."""
    recorder, out = _backend_first_call()
    assert out.dtype == torch.float32
    message = _message("make_backend", recorder)
    assert recorder.calls > 10, message
    assert _returns(recorder.worst_above_passes) == 0, message
    assert _returns(recorder.worst) <= MAX_RETURNS, message


if __name__ == "__main__":
    compiled, _, _ = _compile_first_call()
    print(_message("dlspass.compile", compiled))
    backend, _ = _backend_first_call()
    print(_message("make_backend", backend))
