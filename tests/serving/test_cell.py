"""``ray-xlong serve`` as a subprocess (embedded Ray, one cell, the vLLM engine, HF where vLLM is
not installed): prints its URL, serves the contract to the ``openai`` client, stops cleanly on
Ctrl-C."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from ray_xlong.models import build_tiny_model_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE_ENGINE = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
"""The engine ``serve`` runs here: the default, vLLM, where it is installed (an HF engine behind
the same server: tests/examples/test_examples_on_one_ray.py and the endpoint benchmark's smoke
run)."""


@pytest.mark.slow
@pytest.mark.ray
def test_serve_prints_its_url_serves_and_stops_on_ctrl_c(tmp_path):
    engine = SERVE_ENGINE
    model = build_tiny_model_dir(tmp_path / "tiny-chatml", seed=0, style="chatml")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "ray_xlong.cli", "serve", "--model-dir",
                             str(model), "--port", str(port), "--engine", engine],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline().strip()
        assert line == f"serving http://127.0.0.1:{port}", proc.stderr.read()[-3000:]
        url = line.split()[1]
        run = httpx.post(f"{url}/runs", json={"group_id": "g", "run_id": "s1"}).json()
        client = openai.OpenAI(base_url=run["base_url"], api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-chatml"]
        r = client.chat.completions.create(
            model="tiny-chatml", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            extra_body={"return_token_ids": True})
        assert 1 <= len(r.choices[0].token_ids) <= 8
        rec = httpx.post(f"{url}/runs/s1/end", json={"reward": 1.0}).text.splitlines()
        assert len(rec) == 2 and '"output_ids":' + str(r.choices[0].token_ids).replace(" ", "") \
            in rec[1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
