"""The HTML reports as a person sees them: the demo report (a tiny demo on eager kernels) and
``dlspass analyze``'s page rendered in headless Chromium. The DOM Chromium built has the plots
(figures, series, skipped-step marks, histogram bars), and the screenshot is not blank: it has
the plots' own colours in the numbers of pixels the plots take. Skipped where Debian's
``chromium`` is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dlspass import cli

pytestmark = pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")

WINDOW = (1000, 1600)


def _chromium(tmp_path: Path, page: Path, *args: str,
              size: tuple[int, int] = WINDOW) -> subprocess.CompletedProcess:
    res = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
         f"--window-size={size[0]},{size[1]}", *args, page.as_uri()],
        capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-500:]
    return res


def render(tmp_path: Path, page: Path) -> tuple[str, Image.Image]:
    """The DOM Chromium built from ``page`` and a screenshot of the window."""
    dom = _chromium(tmp_path, page, "--dump-dom").stdout
    shot = tmp_path / (page.stem + ".png")
    _chromium(tmp_path, page, f"--screenshot={shot}")
    return dom, Image.open(shot).convert("RGB")


def pixels_near(img: Image.Image, rgb: tuple[int, int, int], tol: int = 40) -> int:
    diff = np.abs(np.asarray(img, dtype=np.int16) - np.array(rgb, dtype=np.int16))
    return int((diff <= tol).all(axis=-1).sum())


def colours(img: Image.Image) -> int:
    return len(np.unique(np.asarray(img).reshape(-1, 3), axis=0))


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    assert cli.run(["demo", "--steps", "3", "--spike", "2", "-q", "--eager-kernels",
                    "--out-dir", str(out)]) == 0
    return out / "report.html"


def test_demo_report_shows_the_loss_scale_and_time_plots(demo_report, tmp_path, capsys):
    from dlspass.debug.svg_plot import COLORS

    capsys.readouterr()
    dom, img = render(tmp_path, demo_report)
    figures = re.findall(r'<figure class="plot"><figcaption>([^<]*)</figcaption>', dom)
    assert figures == ["training loss per step", "loss scale per step (DLS run), skipped steps marked",
                       "seconds per step (from step 2; the first call compiles)"]
    series = re.findall(r'<polyline class="series" data-series="([^"]*)"', dom)
    runs = ["float32 (eager torch)", "float16, no scaling", "float16 + DLS"]
    assert series == [*runs, "loss scale", *runs]
    # the spike at step 2 is marked on the scale plot: its line and its dot
    assert len(re.findall(r'<line class="mark"', dom)) == 1 and "skipped step 2" in dom
    # the screenshot: not blank, and each run's colour drawn (legend and line), the mark's red too
    assert colours(img) > 50
    for color in COLORS[:3]:
        assert pixels_near(img, _rgb(color)) > 100, color
    assert pixels_near(img, (0xdd, 0x00, 0x00)) > 20


def test_demo_step_drawing_is_by_region_with_the_dls_passes_open(demo_report, tmp_path):
    """The demo's compiled step (900+ ops): each DLS pass drawn small and labelled, open; the
    forward, backward and optimizer folded (Chromium renders no drawing inside a closed
    ``<details>``, so the page's orange is the DLS drawings')."""
    dom = _chromium(tmp_path, demo_report, "--dump-dom").stdout
    opened = re.findall(r'<details class="region dls-pass" data-region="dls" data-pass="(\w+)" open="">', dom)
    assert opened == ["scale_seed", "unscale_grads", "guard_updates", "update_scale"]
    folded = re.findall(r'<details class="region" data-region="(\w+)">', dom)
    assert {"forward", "backward", "optimizer"} <= set(folded)
    total = int(re.search(r"<td>ops</td><td>(\d+)</td>", dom).group(1))
    assert total > 900
    for block in re.findall(r'data-pass="\w+" open="">(.*?)</details>', dom, re.S):
        assert block.count("<circle") <= 60 and block.count('class="label"') == block.count("<circle")
    # the DLS drawings are on screen: their orange (#f28e2b) ops and their labels
    shot = tmp_path / "tall.png"
    _chromium(tmp_path, demo_report, f"--screenshot={shot}", size=(1200, 4000))
    tall = Image.open(shot).convert("RGB")
    assert pixels_near(tall, (0xf2, 0x8e, 0x2b), tol=30) > 2000


def test_analyze_page_shows_the_histograms(tmp_path, capsys):
    page = tmp_path / "analyze.html"
    assert cli.run(["analyze", "cli_factories:mlp", "--format", "html", "-o", str(page),
                    "--formats", "float16,float8_e4m3fn"]) == 0
    capsys.readouterr()
    dom, img = render(tmp_path, page)
    assert dom.count('<svg class="histogram"') == 2 * 3
    assert len(re.findall(r'<rect class="bar"', dom)) > 20
    assert colours(img) > 50
    assert pixels_near(img, (0x33, 0x77, 0xaa)) > 1000  # the in-range bars (#37a)
