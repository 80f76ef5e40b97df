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


def _chromium(tmp_path: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
         f"--window-size={WINDOW[0]},{WINDOW[1]}", *args, page.as_uri()],
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


def test_analyze_page_shows_the_histograms(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).parent)  # cli_factories beside the tests
    page = tmp_path / "analyze.html"
    assert cli.run(["analyze", "cli_factories:mlp", "--format", "html", "-o", str(page),
                    "--formats", "float16,float8_e4m3fn"]) == 0
    capsys.readouterr()
    dom, img = render(tmp_path, page)
    assert dom.count('<svg class="histogram"') == 2 * 3
    assert len(re.findall(r'<rect class="bar"', dom)) > 20
    assert colours(img) > 50
    assert pixels_near(img, (0x33, 0x77, 0xaa)) > 1000  # the in-range bars (#37a)
