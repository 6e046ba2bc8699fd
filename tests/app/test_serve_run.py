"""The README's way in: ``serve run configs/<name>.yaml`` from the repo root, queried with openai.

Every other Serve test builds the application in process; this one goes through
Serve's CLI, which imports ``app.serve_app:build_app`` from the YAML and calls it
itself (and refuses a builder of more than one parameter: that once broke every
config while the in-process tests stayed green). The config is the repo's own,
with only the port changed to a free one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import yaml

from tests.app.fakes import wait_until
from tests.serving import free_port

ROOT = Path(__file__).resolve().parents[2]
START_S = 180


def test_serve_run_aggregated_config_answers_openai(tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "aggregated.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path / "aggregated.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).parent / "serve"
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a new Ray instance, never the one this test process runs
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([str(serve_cli), "run", str(path)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30, max_retries=0)

    def models() -> list[str]:
        try:
            return [m.id for m in client.models.list().data]
        except openai.APIError:
            return []

    try:
        assert wait_until(lambda: bool(models()) or proc.poll() is not None, timeout_s=START_S)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        assert models() == ["windserve-tiny"]
        reply = client.completions.create(model="windserve-tiny", prompt="Hello", max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # serve run in a non-interactive shell ignores SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
