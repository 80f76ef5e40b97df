"""Hostile inputs, round 3 (docs/RELIABILITY.md): what ``analyze`` runs, what the readers
trust, where the writers write, where ``export`` imports from, Model Zoo section typos.

Every crafted file is made here, from a tiny model exported in ``tmp_path``.
"""

from __future__ import annotations

import json
import operator
import os
from pathlib import Path

import pytest
import torch
from hostile_files import SENTINEL, edit_json, members, rewrite, run_cli, run_cli_batch

from dlspass.errors import InputRuntimeError

_MODEL = """
import torch

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.fc(x).sum()

def make():
    torch.manual_seed(0)
    return M(), (torch.randn(2, 3),)
"""


def _one_error_line(res) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.rc == 2 and len(lines) == 1 and lines[0].startswith("dlspass: error: "), res.stderr


@pytest.fixture(scope="module")
def joint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A joint program of a tiny model, written by ``dlspass export``."""
    folder = tmp_path_factory.mktemp("joint")
    (folder / "r3model.py").write_text(_MODEL)
    res = run_cli(["export", "r3model:make", "-o", "joint.pt2"], folder, timeout=300)
    assert res.rc == 0, res.stderr
    return folder / "joint.pt2"


def _with_nodes(joint: Path, dst: Path, add) -> Path:
    """``joint`` with the nodes ``add(ep, graph, output_node)`` inserts, saved as torch does."""
    from dlspass.capture.pt2_io import load_program, save_program

    ep, meta = load_program(joint)
    g = ep.graph_module.graph
    out = g.find_nodes(op="output")[0]
    with g.inserting_before(out):
        add(ep, g)
    ep.graph_module.recompile()
    save_program(ep, dst, meta)
    return dst


def _zeros(n: int):
    def add(ep, g):
        node = g.call_function(torch.ops.aten.zeros.default, ([n],),
                               {"dtype": torch.float32, "device": torch.device("cpu")})
        with torch._subclasses.FakeTensorMode():
            node.meta["val"] = torch.zeros(n)
    return add


def _print(fmt: str):
    def add(ep, g):
        x = g.find_nodes(op="placeholder")[-1]
        g.call_function(torch.ops.higher_order.print, (fmt,), {"x": x}).meta["val"] = None
    return add


class _Cond(torch.nn.Module):
    def forward(self, i):
        return i < 10


class _Body(torch.nn.Module):
    def forward(self, i):
        return (i + 0,)  # the condition never changes: the loop never ends


class _Loop(torch.nn.Module):
    def forward(self, i):
        return torch._higher_order_ops.while_loop(_Cond(), _Body(), (i,))


def _endless_loop(ep, g):
    # the subgraphs as torch.export makes them (with the metadata its serializer wants)
    made = torch.export.export(_Loop(), (torch.tensor(0),)).graph_module
    ep.graph_module.add_submodule("endless_cond", made.while_loop_cond_graph_0)
    ep.graph_module.add_submodule("endless_body", made.while_loop_body_graph_0)
    cond, body = g.get_attr("endless_cond"), g.get_attr("endless_body")
    zero = g.call_function(torch.ops.aten.scalar_tensor.default, (0,), {"dtype": torch.int64})
    loop = g.call_function(torch.ops.higher_order.while_loop, (cond, body, (zero,), ()))
    first = g.call_function(operator.getitem, (loop, 0))
    with torch._subclasses.FakeTensorMode():
        zero.meta["val"] = torch.tensor(0)
        loop.meta["val"] = (torch.tensor(0),)
        first.meta["val"] = torch.tensor(0)


# ---- 1. analyze runs only tensor arithmetic, within bounds ------------------------------------

def test_analyze_refuses_a_loop_that_never_ends(joint: Path, tmp_path: Path) -> None:
    bad = _with_nodes(joint, tmp_path / "loop.pt2", _endless_loop)
    res = run_cli(["analyze", bad], tmp_path, timeout=60)  # today: hangs past the timeout
    _one_error_line(res)
    assert "while_loop" in res.stderr


@pytest.mark.parametrize("n", [2**29, 2**38])
def test_analyze_refuses_a_huge_allocation_before_making_it(joint: Path, tmp_path: Path, n: int) -> None:
    bad = _with_nodes(joint, tmp_path / "zeros.pt2", _zeros(n))
    res = run_cli(["analyze", bad], tmp_path, timeout=120)
    _one_error_line(res)
    assert "would allocate" in res.stderr
    # nothing near the 2 GiB that 2**29 float32 zeros take (torch itself is ~400 MB)
    assert res.peak_rss_mb < 1000, res.peak_rss_mb


def test_analyze_still_runs_a_program_within_its_bounds(joint: Path, tmp_path: Path) -> None:
    ok = _with_nodes(joint, tmp_path / "small.pt2", _zeros(1000))
    res = run_cli(["analyze", ok], tmp_path, timeout=120)
    assert res.rc == 0, res.stderr


@pytest.mark.parametrize("fmt", ["{x.__class__.__init__.__globals__[os].environ[R3_SECRET]}",
                                 "{x}"])
def test_print_program_leaks_nothing_in_any_command(joint: Path, tmp_path: Path, fmt: str) -> None:
    bad = _with_nodes(joint, tmp_path / "print.pt2", _print(fmt))
    os.environ["R3_SECRET"] = "hunter2-r3"
    try:
        results = run_cli_batch({c: (args, tmp_path) for c, args in {
            "analyze": ["analyze", bad], "inspect": ["inspect", bad], "verify": ["verify", bad],
            "transform": ["transform", bad, "-o", tmp_path / "out.pt2"]}.items()}, timeout=120)
    finally:
        del os.environ["R3_SECRET"]
    for name, res in results.items():
        _one_error_line(res)  # transform: exit 3 with a traceback today
        assert "hunter2" not in res.stderr, name
    assert not (tmp_path / "out.pt2").exists()


# ---- 2. metadata of the wrong type; strings the escaper must catch ---------------------------

def _custom_edit(value):
    def edit(obj):
        for node in obj["graph_module"]["graph"]["nodes"]:
            if "custom" in node["metadata"]:
                custom = json.loads(node["metadata"]["custom"])
                custom["dlspass_role"] = value
                node["metadata"]["custom"] = json.dumps(custom)
                return
        raise AssertionError("no node with custom metadata")
    return edit


@pytest.fixture(scope="module")
def step(joint: Path) -> Path:
    out = joint.parent / "step.pt2"
    res = run_cli(["transform", joint, "-o", out], joint.parent, timeout=300)
    assert res.rc == 0, res.stderr
    return out


@pytest.mark.parametrize("value", [{"a": 1}, ["loss"], 7])
def test_custom_metadata_of_the_wrong_type_is_exit_2(step: Path, tmp_path: Path, value) -> None:
    bad = edit_json(step, tmp_path / "custom.pt2", "models/model.json", _custom_edit(value))
    results = run_cli_batch({c: ([c, bad], tmp_path) for c in ("inspect", "verify")}, timeout=120)
    for res in results.values():
        _one_error_line(res)
        assert "dlspass_role" in res.stderr


def _target_edit(name: str):
    def edit(obj):
        hit = False
        for node in obj["graph_module"]["graph"]["nodes"]:
            custom = json.loads(node["metadata"].get("custom", "{}"))
            if "dlspass_target" in custom:
                custom["dlspass_target"] = name
                node["metadata"]["custom"] = json.dumps(custom)
                hit = True
        assert hit, "no node with a target"
    return edit


def _meta_edit(src: Path, dst: Path, key: str, value) -> Path:
    _, files = members(src)
    meta = json.loads(files["extra/dlspass.json"])
    meta[key] = value
    return rewrite(src, dst, {"extra/dlspass.json": json.dumps(meta).encode()})


@pytest.mark.parametrize("where", ["target", "tied"])
def test_surrogates_and_noncharacters_from_a_file_are_escaped(step: Path, joint: Path, tmp_path: Path,
                                                              where: str) -> None:
    import xml.dom.minidom

    nasty = "w\udc80\ufffe\ufdd0"
    if where == "target":
        bad = edit_json(step, tmp_path / "t.pt2", "models/model.json", _target_edit(nasty))
    else:
        bad = _meta_edit(joint, tmp_path / "t.pt2", "tied", {nasty: "fc.weight"})
    fmts = ("text", "json", "svg", "html")
    results = run_cli_batch({f: (["inspect", bad, "--format", f, "-o", f"r.{f}"], tmp_path)
                             for f in fmts}, timeout=120)
    for f, res in results.items():
        assert res.rc == 0, (f, res.stderr)  # today: exit 3, "surrogates not allowed"
        text = (tmp_path / f"r.{f}").read_text(encoding="utf-8")
        assert not any(c in text for c in "\udc80\ufffe\ufdd0"), f
    xml.dom.minidom.parse(str(tmp_path / "r.svg"))  # a valid XML document
    json.loads((tmp_path / "r.json").read_text())


def test_non_utf8_file_names_are_shown_escaped(step: Path, tmp_path: Path) -> None:
    name = os.fsdecode(b"st\xffep.pt2")
    os.link(step, tmp_path / name)
    out = os.fsdecode(b"rep\xfe.txt")
    results = run_cli_batch({"inspect": (["inspect", name, "-o", out], tmp_path),
                             "verify": (["verify", name], tmp_path)}, timeout=120)
    for res in results.values():
        assert res.rc == 0, res.stderr  # today: exit 3, "surrogates not allowed"
    assert "\\udcfe" in results["inspect"].stderr


def test_the_escaper_covers_controls_bidi_surrogates_and_noncharacters() -> None:
    from dlspass.files.bounded_text import printable

    for ch in ["\x1b", "\x9b", "\u202e", "\u2067", "\u200f", "\udc80", "\ufdd0", "\ufffe",
               "\U0010ffff", "\U0001fffe"]:
        text = printable(f"a{ch}b")
        assert ch not in text and text.startswith("a\\") and text.endswith("b")
        text.encode("utf-8")  # always encodable


def test_one_excerpt_for_every_error_message() -> None:
    from dlspass import presets
    from dlspass.files import bounded_text

    assert presets.excerpt("a\udc80\u202e") == bounded_text.excerpt("a\udc80\u202e", 60, plain=True)
    assert "\udc80" not in presets.excerpt("a\udc80")


# ---- 3. analyze's names are escaped ------------------------------------------------------------

_NASTY = """
import torch

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module("evil\\x1b]0;owned\\x07\\u202e", torch.nn.Linear(3, 1))

    def forward(self, x):
        return next(iter(self.children()))(x).sum() * 1e-30

def make():
    torch.manual_seed(0)
    return M(), (torch.randn(2, 3),)
"""


@pytest.mark.parametrize("fmt", ["text", "html"])
def test_analyze_escapes_parameter_names(tmp_path: Path, fmt: str) -> None:
    (tmp_path / "r3nasty.py").write_text(_NASTY)
    res = run_cli(["analyze", "r3nasty:make", "--format", fmt, "-o", f"r.{fmt}"], tmp_path, timeout=120)
    assert res.rc == 0, res.stderr
    text = (tmp_path / f"r.{fmt}").read_text(encoding="utf-8")
    assert "evil" in text  # the name is reported ...
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text  # ... escaped


# ---- 4. readers bound their work before doing it ----------------------------------------------

def _scaler_folder(folder: Path) -> Path:
    import warnings

    from dlspass.checkpoint import save_scaler
    from dlspass.scaler import GradScaler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_scaler(GradScaler(init_scale=2.0**10), str(folder))
    return folder


def _rewrite_metadata(folder: Path, edit) -> Path:
    import pickle

    meta = pickle.loads((folder / ".metadata").read_bytes())  # our own file: trusted here
    edit(meta)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return folder


@pytest.mark.parametrize("where", ["planner_data", "index"])
def test_dcp_metadata_sharing_one_tuple_is_refused_before_it_is_walked(tmp_path: Path, where: str) -> None:

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from dlspass.checkpoint import CheckpointError
    from dlspass.files.dcp_reader import read_metadata

    tree: tuple = ()
    for _ in range(22):  # 2**22 leaves, a few hundred bytes pickled: str() of it is 25 MB
        tree = (tree, tree)

    def edit(meta):
        if where == "planner_data":
            meta.planner_data = {"x": tree}
        else:
            info = next(iter(meta.storage_data.values()))
            info.relative_path = "../elsewhere"  # an error that quotes the index
            meta.storage_data = {MetadataIndex(fqn=tree): info}

    folder = _rewrite_metadata(_scaler_folder(tmp_path / "dcp"), edit)
    assert len((folder / ".metadata").read_bytes()) < 4096
    with pytest.raises(CheckpointError.__mro__[1]) as info:  # InputValueError
        read_metadata(folder)
    assert "objects" in str(info.value) and len(str(info.value)) < 600


@pytest.mark.parametrize("copies", [64, 4106])
def test_dcp_entries_sharing_one_storage_are_checked_once(tmp_path: Path, copies: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from dlspass.files import dcp_reader

    def edit(meta):
        info = next(iter(meta.storage_data.values()))
        meta.storage_data = {MetadataIndex(fqn=f"copy{i}"): info for i in range(copies)}

    folder = _rewrite_metadata(_scaler_folder(tmp_path / "dcp"), edit)
    calls = []
    real = dcp_reader.check_zip_bounds  # the name the reader calls (imported at its top)
    monkeypatch.setattr(dcp_reader, "check_zip_bounds", lambda *a, **k: calls.append(1) or real(*a, **k))
    dcp_reader.read_metadata(folder)
    assert len(calls) == 1  # today: once per entry (4,106 inflations of one zip)


def test_latest_checkpoint_stops_after_a_few_unreadable_files(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from dlspass import checkpoint as ck

    good = ck.save_checkpoint(ck.checkpoint_path(tmp_path, 1), torch.nn.Linear(2, 2), None, None,
                              None, step=1)
    for step in range(2, 102):  # 100 decoys newer than the good one
        ck.checkpoint_path(tmp_path, step).write_bytes(good.read_bytes()[:-10])
    reads = []
    real = ck.read_checkpoint
    monkeypatch.setattr(ck, "read_checkpoint", lambda p, *a, **k: reads.append(p) or real(p, *a, **k))
    with pytest.raises(ck.CheckpointError) as info:
        ck.latest_checkpoint(tmp_path)
    assert "unreadable" in str(info.value)
    assert len(reads) <= 8  # today: all 100 decoys are read, then the good one returned


@pytest.mark.parametrize("hole", [64 * 2**20, 6 * 2**30])
def test_sparse_checkpoint_is_refused_from_its_size(tmp_path: Path, hole: int) -> None:
    from dlspass import checkpoint as ck

    good = ck.save_checkpoint(tmp_path / "good.pt", torch.nn.Linear(2, 2), None, None, None, step=1)
    sparse = tmp_path / "holes.pt"  # a name the message cannot match by accident
    with open(sparse, "wb") as f:
        f.seek(hole)  # a hole: no blocks on disk
        f.write(good.read_bytes())  # a valid zip at the end: zipfile finds it
    if os.stat(sparse).st_blocks * 512 >= hole:
        pytest.skip("this file system does not make sparse files")
    with pytest.raises(ck.CheckpointError) as info:
        ck.read_checkpoint(sparse)  # today: reads the whole hole (6 GiB: MemoryError)
    msg = str(info.value)
    # refused from stat alone: as sparse, or (6 GiB) as larger than any checkpoint read
    assert "a sparse file" in msg or hole > ck.MAX_CHECKPOINT_BYTES and "more than the" in msg, msg


def test_oversized_checkpoint_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlspass import checkpoint as ck

    good = ck.save_checkpoint(tmp_path / "good.pt", torch.nn.Linear(2, 2), None, None, None, step=1)
    monkeypatch.setattr(ck, "MAX_CHECKPOINT_BYTES", good.stat().st_size - 1, raising=False)
    with pytest.raises(ck.CheckpointError) as info:
        ck.read_checkpoint(good)
    assert "more than" in str(info.value)


# ---- 5. writers never write through a planted path -----------------------------------------------

def test_atomic_write_never_writes_through_a_symlinked_target(tmp_path: Path) -> None:
    from dlspass.files.atomic_write import write_text_atomic

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "report.html").symlink_to(victim)
    write_text_atomic(tmp_path / "report.html", "new")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "report.html").is_symlink()
    assert (tmp_path / "report.html").read_text() == "new"


def test_atomic_write_refuses_a_temporary_file_swapped_for_a_link(tmp_path: Path) -> None:
    from dlspass.files.atomic_write import write_atomic

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")

    def swap_then_write(tmp: str) -> None:
        os.unlink(tmp)
        os.symlink(victim, tmp)
        Path(tmp).write_text("evil")  # a writer that reopens the name follows the link

    with pytest.raises(InputRuntimeError, match="replaced while being written"):
        write_atomic(tmp_path / "out.txt", swap_then_write)
    assert not (tmp_path / "out.txt").exists()  # the link never becomes the output


def test_demo_writes_through_no_planted_tmp_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlspass.cli import demo

    out = tmp_path / "out"
    out.mkdir()
    victims = {}
    for name in ("report.html", "demo_metrics.json"):
        victim = tmp_path / f"victim-{name}"
        victim.write_text("precious")
        (out / f"{name}.tmp").symlink_to(victim)
        victims[name] = victim
        demo._write(out / name, "written")
    for name, victim in victims.items():
        assert victim.read_text() == "precious"  # today: overwritten through the link
        assert (out / name).read_text() == "written"


# ---- 6. export imports nothing from the current folder that shadows an installed module -------

@pytest.mark.parametrize("shadow", ["filelock", "sympy", "typing_extensions"])
def test_export_runs_no_shadowing_module_from_the_current_folder(tmp_path: Path, shadow: str) -> None:
    (tmp_path / "r3model.py").write_text(_MODEL)
    (tmp_path / f"{shadow}.py").write_text(f"open({SENTINEL!r}, 'w').write('x')\n")
    res = run_cli(["export", "r3model:make", "-o", "j.pt2"], tmp_path, timeout=300)
    assert not (tmp_path / SENTINEL).exists()
    assert res.rc == 0, res.stderr  # the user's own module beside them still resolves


# ---- 7. Model Zoo: a near miss of a section is refused, never read as "no precision" ----------

_DLS = {"enabled": True, "fp16_type": "float16", "loss_scaling_factor": "dynamic"}


@pytest.mark.parametrize("doc, near", [
    ({"trainer": {"init": {"precison": _DLS}}}, "precision"),
    ({"trainer": {"init": {"Precision": _DLS}}}, "precision"),
    ({"trainer": {"init": {"\u0440recision": _DLS}}}, "precision"),  # Cyrillic er
    ({"trainer": {"\u0456nit": {"precision": _DLS}}}, "init"),  # Cyrillic i
    ({"trainer": {"Init": {"precision": _DLS}}}, "init"),
    ({"Trainer": {"init": {"precision": _DLS}}}, "trainer"),
    ({"optimzer": {"loss_scaling_factor": "dynamic"}, "model": {"mixed_precision": True}}, "optimizer"),
    ({"optimizer": {"l\u043ess_scaling_factor": "dynamic"}, "model": {"mixed_precision": True}},
     "loss_scaling_factor"),  # Cyrillic o (refused on main already, by difflib's ratio)
    ({"optimizer": {"loss_scaling_factor": "dynamic"}, "model": {"mixed_precision": True,
                                                                 "FP16_TYPE": "float16"}},
     "fp16_type"),  # case: difflib's ratio misses it, and the release's default format is used
    ({"optimizer": {"loss_scaling_factor": "dynamic"}, "Model": {"mixed_precision": True}}, "model"),
])
@pytest.mark.parametrize("release", [None, "2.3", "2.5", "2.0", "1.9"])
def test_near_miss_sections_are_refused(tmp_path: Path, doc: dict, near: str, release) -> None:
    from dlspass.config import ConfigError, DLSConfig
    from dlspass.modelzoo_releases import modelzoo_rules

    if release is not None and "trainer" in json.dumps(doc).lower() and \
            not modelzoo_rules(release, None).has_trainer:
        pytest.skip("the trainer layout is refused whole before 2.3")
    path = tmp_path / "params.yaml"
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")  # JSON is YAML
    kwargs = {} if release is None else {"modelzoo_release": release}
    with pytest.raises(ConfigError) as info:
        DLSConfig.from_yaml(str(path), **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and repr(near) in msg, msg


def test_transform_config_with_a_misspelt_section_is_exit_2(joint: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "params.yaml"
    cfg.write_text(json.dumps({"trainer": {"init": {"precison": _DLS}}}))
    res = run_cli(["transform", joint, "-o", tmp_path / "s.pt2", "--config", cfg], tmp_path, timeout=300)
    _one_error_line(res)  # today: exit 0 and a step without loss scaling
    assert not (tmp_path / "s.pt2").exists()


def test_exact_sections_beside_unrelated_keys_still_read(tmp_path: Path) -> None:
    from dlspass.config import DLSConfig

    doc = {"trainer": {"init": {"precision": _DLS, "loggers": [], "logging": {"log_steps": 5},
                                "seed": 1, "model_dir": "x"}, "fit": {}, "validate": {}},
           "train_input": {}, "eval_input": {}}
    path = tmp_path / "params.yaml"
    path.write_text(json.dumps(doc))
    cfg = DLSConfig.from_yaml(str(path))
    assert cfg.mixed_precision and cfg.loss_scale == "dynamic"

