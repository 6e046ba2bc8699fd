"""The README's way in: ``serve run configs/<name>.yaml`` from the repo root, queried with openai.

Every other Serve test builds the application in process; these go through
Serve's CLI, which imports ``app.serve_app:build_app`` from the YAML and calls it
itself (and refuses a builder of more than one parameter: that once broke every
config while the in-process tests stayed green). The config is the repo's own,
with only the port changed to a free one. One run goes through Serve's Python
proxy, one through Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``: HAProxy
on the port, forwarding to the ingress replica's own HTTP server), the README's
lower-latency way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import psutil
import pytest
import yaml

from bench.serve.compare import haproxy_processes
from tests.app.fakes import wait_until
from tests.serving import free_port

ROOT = Path(__file__).resolve().parents[2]
START_S = 180


@contextlib.contextmanager
def serve_run(tmp_path: Path, config_name: str, env: dict[str, str]):
    """``serve run`` of the repo's config on a free port, in a new Ray instance; yields (port, client)."""
    config = yaml.safe_load((ROOT / "configs" / config_name).read_text())
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path / config_name
    path.write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).parent / "serve"
    env = {**os.environ, "RAY_ADDRESS": "local", **env}  # a new Ray instance, never the one this test process runs
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
        yield port, client
    finally:
        haproxies = haproxy_processes(psutil.Process(proc.pid)) if proc.poll() is None else []
        os.killpg(proc.pid, signal.SIGTERM)  # serve run in a non-interactive shell ignores SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
        for process in haproxies:  # HAProxy outlives a killed `serve run` (its own process group)
            with contextlib.suppress(psutil.Error):
                process.kill()


def listener(port: int) -> psutil.Process:
    """The process listening on 127.0.0.1:``port``."""
    (pid,) = {c.pid for c in psutil.net_connections("tcp")
              if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.laddr.ip == "127.0.0.1"}
    return psutil.Process(pid)


def test_serve_run_aggregated_config_answers_openai(tmp_path):
    with serve_run(tmp_path, "aggregated.yaml", {}) as (port, client):
        assert listener(port).name() != "haproxy"  # Serve's proxy actor holds the port
        reply = client.completions.create(model="windserve-tiny", prompt="Hello", max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"


def test_serve_run_behind_haproxy_streams_the_tokens_it_answers_and_rejects_bad_input(tmp_path):
    # HAProxy's stats and metrics pages bind fixed ports on every interface (Serve's template): free ones here
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}
    with serve_run(tmp_path, "aggregated.yaml", env) as (port, client):
        assert listener(port).name() == "haproxy"  # the requests below reach the replica through HAProxy
        prompt = "The first words of a story:"
        whole = client.completions.create(model="windserve-tiny", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
        chunks = list(client.completions.create(model="windserve-tiny", prompt=prompt, max_tokens=12,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert len([c for c in chunks if c.choices and c.choices[0].text]) >= 2  # streamed, not one piece
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="windserve-tiny", prompt=prompt, max_tokens=-1)
        assert bad.value.status_code == 400 and bad.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt=prompt, max_tokens=4)
