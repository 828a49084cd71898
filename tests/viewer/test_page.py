"""The run viewer: ``ray-xlong inspect RUNS --html OUT --tokenizer DIR`` on a recorded harness
run with known branching (retry, subagent, compaction; K=3 so two trajectories are dropped).

The page is checked twice: as HTML (every call in order, decoded text, kept / dropped rows,
trainable spans, nothing loaded from elsewhere) and in a real headless Chromium (Debian package
``chromium``): the DOM the browser built holds the runs, and the screenshot shows the two
highlight colours (model-generated and trainable tokens) actually painted. Skipped only when no
chromium binary is installed (CI: ``apt-get install -y chromium``).
"""

from __future__ import annotations

import asyncio
import html.parser
import os
import shutil
import subprocess

import numpy as np
import pytest

from ray_xlong.cli import main
from ray_xlong.models import load_model
from ray_xlong.rollout import Harness, ScriptedEngine
from ray_xlong.rollout.tasks import ArithmeticTask
from ray_xlong.trajectory.recording import write_runs
from ray_xlong.trajectory.synthetic import synthetic_runs
from tests.rollout.test_harness import CONFIG, branching_policy

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
GEN, TRAINABLE = (0xFF, 0xE0, 0x8A), (0x9B, 0xE3, 0xA6)     # .gen / .trainable in page.CSS


class Outline(html.parser.HTMLParser):
    """Counts elements by class and keeps the visible text and every src / href."""

    def __init__(self):
        super().__init__()
        self.classes, self.links, self.text = {}, [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for cls in (attrs.get("class") or "").split():
            self.classes[cls] = self.classes.get(cls, 0) + 1
        self.links += [attrs[k] for k in ("src", "href") if attrs.get(k)]

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def recording(tmp_path_factory, model_dir, chat):
    """One scripted harness run (7 calls) + two synthetic runs, as a runs JSONL."""
    task = ArithmeticTask(5)
    engine = ScriptedEngine(branching_policy(chat, task), vocab_size=512,
                            model=load_model(model_dir))
    result = asyncio.run(Harness(engine, chat, config=CONFIG).run(task, run_id="r0",
                                                                   group_id="g0"))
    path = tmp_path_factory.mktemp("rec") / "runs.jsonl"
    write_runs(path, [result.run, *synthetic_runs(1, groups=1, runs_per_group=2)])
    return path, result.run


@pytest.fixture(scope="module")
def page(recording, model_dir, tmp_path_factory):
    path, _ = recording
    out = tmp_path_factory.mktemp("view") / "runs.html"
    assert main(["inspect", str(path), "--max-trajectories", "3", "--no-tree",
                 "--html", str(out), "--tokenizer", str(model_dir)]) == 0
    return out


def test_page_holds_every_run_call_and_trajectory(page, recording):
    _, run = recording
    doc = Outline()
    doc.feed(page.read_text())
    text = "".join(doc.text)
    assert doc.classes["run"] == 3
    assert doc.classes["call"] == 7 + _synthetic_calls(recording)
    # K = 3: r0 keeps 3 of its 5 (drops 2); the synthetic runs keep both of theirs
    assert doc.classes["kept"] == 3 + 2 + 2 and doc.classes["dropped"] == 2
    assert doc.classes["trainable"] > 0 and doc.classes["gen"] >= 7
    assert "add" in text and "sum" in text          # decoded text, not ids
    assert all(link.startswith("#") for link in doc.links)        # self-contained


def _synthetic_calls(recording) -> int:
    from ray_xlong.trajectory.recording import read_runs

    return sum(len(r.calls) for r in read_runs(recording[0])[1:])


def test_without_a_tokenizer_the_page_shows_ids(recording, tmp_path):
    path, run = recording
    out = tmp_path / "ids.html"
    assert main(["inspect", str(path), "--no-tree", "--html", str(out)]) == 0
    first_output = " ".join(str(int(i)) for i in run.calls[0].output_ids[:5])
    assert first_output in out.read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary: apt-get install -y chromium")
def test_page_renders_in_headless_chromium(page, tmp_path):
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    url = page.resolve().as_uri()
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    rendered = Outline()
    rendered.feed(dom)
    assert rendered.classes["run"] == 3 and rendered.classes["node"] > 0
    shot = pathlib_out(tmp_path) / "viewer.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1400,1800",
                    "--hide-scrollbars", url], capture_output=True, timeout=120, check=True)
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    colours = {tuple(p) for p in np.unique(pixels, axis=0)}
    assert len(colours) > 50                   # text and tables, not a blank page
    assert GEN in colours and TRAINABLE in colours, "highlighted spans were not painted"


def pathlib_out(tmp_path):
    """Where the screenshot goes: $RAY_XLONG_TEST_OUT when set (to keep it), else tmp."""
    import pathlib

    out = pathlib.Path(os.environ.get("RAY_XLONG_TEST_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out
