"""The inspect HTML's graph by region: every node in exactly one region, the forward what the
backward seed is computed from, the backward what leads from the seed to the gradients, the DLS
passes' ops in open blocks drawn with their neighbourhood (a few targets of a per-parameter
pass), the rest folded; no script."""

from __future__ import annotations

import re

import torch
from torch import nn

import dlspass
from dlspass.debug.inspect_report import render, summarize_graph
from dlspass.debug.step_regions import DLS_PASSES, step_regions
from dlspass.graph import roles


def _step():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(8)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    return dlspass.capture_step(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), opt, batch,
                                dlspass.DLSConfig(fp16_type="float16"))


def test_every_node_is_in_one_region_and_the_regions_follow_the_roles():
    step = _step()
    gm = step.graph_module
    report = summarize_graph(gm, name="mlp step")
    regions = step_regions(report)
    ids = [i for v in regions.values() for i in v]
    assert sorted(ids) == sorted(n.name for n in gm.graph.nodes)  # each node once
    node = {n.name: n for n in gm.graph.nodes}
    seed = roles.the_node(gm.graph, roles.SEED)
    # independent of the report: the forward is what the seed depends on, no inserted node
    forward = {n.name for n in roles.ancestors([seed]) - {seed} if n.op == "call_function"
               and roles.pass_of(n) is None}
    assert set(regions["forward"]) == forward
    assert seed.name in regions["backward"]  # the seed starts the backward
    assert any(node[i].target == torch.ops.aten.addmm.default for i in regions["forward"])
    # the backward: the gradients themselves and the mm of the weight gradients
    grads = {n.name for n in roles.nodes_with_role(gm.graph, roles.GRAD)}
    assert grads <= set(regions["backward"])
    assert {roles.pass_of(node[i]) for i in regions["dls"]} <= set(DLS_PASSES)
    assert {node[i].op for i in regions["io"]} == {"placeholder", "output"}
    assert "optimizer" in regions and "casts" in regions


def test_html_opens_the_dls_passes_small_and_folds_the_rest():
    report = summarize_graph(_step().graph_module, name="mlp step")
    page = render(report, "html")
    assert "<script" not in page
    blocks = re.findall(r'<details class="([^"]*)" data-region="(\w+)"( data-pass="(\w+)")?( open)?>'
                        r'<summary>([^<]*)</summary><div class="graph">(.*?)</div></details>', page, re.S)
    opened = [(b[3], b[6]) for b in blocks if b[4]]
    assert [p for p, _ in opened] == ["scale_seed", "unscale_grads", "guard_updates", "update_scale"]
    assert all(b[1] == "dls" for b in blocks if b[4])
    folded = [b[1] for b in blocks if not b[4]]
    assert folded == ["forward", "backward", "optimizer", "casts", "io"]
    guard = next(b for b in blocks if b[3] == "guard_updates")
    # 16 parameters and their 48 Adam states (step, exp_avg, exp_avg_sq) guarded; drawn for 3,
    # each op labelled
    assert "drawn for 3 of its 64 targets" in guard[5]
    assert guard[6].count("<circle") < 30 and guard[6].count('class="label"') == guard[6].count("<circle")
    # a folded block still holds its whole region's drawing
    fwd = next(b for b in blocks if b[1] == "forward")
    assert fwd[6].count("<circle") == int(re.search(r"forward: (\d+) ops", fwd[5]).group(1))
