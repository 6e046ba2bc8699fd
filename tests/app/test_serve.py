"""The Serve application end to end: real Ray, real Serve, real workers, HTTP on 127.0.0.1.

Two applications run side by side for the whole module:

    /disagg  ContextWorker + GenerationWorker over NIXL, n-gram drafts (no API key, no queue limit)
    /agg     AggregatedWorker without drafts, with an API key and max_queue=1, called over Ray actor
             calls (handle_transport "ray"; /disagg's ingress calls its workers over gRPC, the default)
    /local   an aggregated engine in the ingress replica itself (engine_in_ingress), no worker deployment
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from app.serve_app import SERVE_CONTROLLER_OPTIONS, build_app
from engine.model_registry import resolve_model_path
from engine.tokenizer import Tokenizer
from tests.app.fakes import openai_client, wait_until
from tests.serving import serving

MODEL = "windserve-tiny"
API_KEY = "test-key"
ENGINE = {"model": MODEL, "tokens_per_block": 8, "num_pages": 128, "max_num_seqs": 16, "device": "cpu"}
MAX_DRAFT_LEN = 2
MAX_MODEL_LEN = 128 * 8 - MAX_DRAFT_LEN  # what one request can hold in num_pages, below the model's 4096 positions
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
# Shorter and longer than the 32-token window, crossing 8-token blocks.
PROMPTS = ["Hi", "The capital of France is", "abcabcabcabcabcabcabcabcabcabcabcabc", "windows " * 9]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    apps = {"disagg": build_app({**ENGINE, "mode": "disagg", "max_draft_len": MAX_DRAFT_LEN}),
            "agg": build_app({**ENGINE, "mode": "aggregated", "transport": "local", "api_key": API_KEY,
                              "max_queue": 1, "handle_transport": "ray"}),
            "local": build_app({**ENGINE, "mode": "aggregated", "transport": "local", "engine_in_ingress": True})}
    with serving(apps) as url:
        yield url


@pytest.fixture(scope="module")
def disagg_url(base_url: str) -> str:
    return f"{base_url}/disagg"


@pytest.fixture(scope="module")
def agg_url(base_url: str) -> str:
    return f"{base_url}/agg"


@pytest.fixture(scope="module")
def local_url(base_url: str) -> str:
    return f"{base_url}/local"


@pytest.fixture(scope="module")
def client(disagg_url: str) -> openai.OpenAI:
    return openai_client(disagg_url).with_options(timeout=60)


@pytest.fixture(scope="module")
def agg_client(agg_url: str) -> openai.OpenAI:
    return openai_client(agg_url, api_key=API_KEY).with_options(timeout=60)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model_path(MODEL))


def metric_samples(url: str, name: str) -> dict[tuple[str, str], float]:
    """(worker, role) -> value of one worker series in /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.labels["worker"], s.labels["role"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


def in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "windserve_requests_in_flight")


def pages_in_use(url: str, role: str) -> float:
    return sum(v for (_, r), v in metric_samples(url, "windserve_kv_pages_in_use").items() if r == role)


def pages_all_free(url: str) -> bool:
    in_use = metric_samples(url, "windserve_kv_pages_in_use")
    return bool(in_use) and all(value == 0 for value in in_use.values())


def sse_payloads(raw: bytes) -> list[str]:
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.decode("utf-8").split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    return [event[len("data: "):] for event in events[:-1]]


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_usage_counts_tokens(client, tokenizer):
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, **GREEDY)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[1]))
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_chat_usage_counts_template_tokens(client, tokenizer):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **GREEDY)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(tokenizer.apply_chat_template(MESSAGES))
    assert reply.usage.completion_tokens == 8


def test_streamed_chunks_concatenate_to_the_full_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20

    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, **GREEDY)
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content


def test_stop_string_cuts_the_text(client):
    text = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, **GREEDY).choices[0].text
    # An ASCII character that first appears past the start: the text before it is what a stop on it leaves.
    cut = next((k for k in range(1, len(text)) if text[k].isascii() and text[k].isprintable()
                and text[k] not in text[:k]), None)
    assert cut is not None, f"no usable stop character in {text!r}"
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, stop=[text[cut]], **GREEDY)
    assert reply.choices[0].text == text[:cut]
    assert reply.choices[0].finish_reason == "stop"


def test_same_seed_same_sample(client):
    def sample(seed: int) -> str:
        reply = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0.8,
                                          seed=seed, extra_body={"ignore_eos": True})
        return reply.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_error_statuses(client, agg_url):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
    assert info.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="a" * MAX_MODEL_LEN, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    assert info.value.status_code == 404
    with pytest.raises(openai.AuthenticationError) as info:
        openai_client(agg_url, api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert info.value.status_code == 401


def test_full_queue_is_503_with_retry_after(agg_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=agg_url, headers=headers, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # held: a dropped line iterator closes the connection
            next(lines)  # admitted and running
            second = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 4})
        assert second.status_code == 503
        assert second.headers["Retry-After"] == "1"
        assert second.json()["error"]["code"] == "overloaded"
        assert wait_until(lambda: in_flight(agg_url) == 0, timeout_s=20)
        assert wait_until(lambda: pages_all_free(agg_url), timeout_s=20)


def test_sse_wire_format(disagg_url):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 6, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{disagg_url}/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read()
    chunks = [json.loads(p) for p in sse_payloads(raw)[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


def settled_cancellations(board) -> dict[str, int]:
    """``num_cancelled`` per role once two board snapshots 1.5 s apart agree: each replica reports every
    second, so an earlier test's cancellation cannot land after this reading and pass for ours."""
    previous = None
    for _ in range(20):
        now = {e["role"]: e["num_cancelled"] for e in board.snapshot.remote().result()}
        if now == previous:
            return now
        previous = now
        time.sleep(1.5)
    raise AssertionError(f"the board's cancellation counts never settled: {now}")


def leave_mid_stream(url: str, role: str) -> None:
    """Open a long stream, read 5 lines, see ``role``'s pages in use, then drop the connection."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        for _ in range(5):
            next(lines)
        assert wait_until(lambda: pages_in_use(url, role) > 0, timeout_s=10)


def test_disconnect_mid_stream_aborts_and_frees_pages_on_both_workers(disagg_url):
    assert wait_until(lambda: pages_all_free(disagg_url), timeout_s=20)
    board = serve.get_deployment_handle("WorkerStats", app_name="disagg")
    cancelled_before = settled_cancellations(board)
    leave_mid_stream(disagg_url, "generation")
    assert wait_until(lambda: pages_all_free(disagg_url), timeout_s=20)
    assert wait_until(lambda: {e["role"]: e["num_cancelled"] for e in board.snapshot.remote().result()}
                      .get("generation", 0) > cancelled_before["generation"], timeout_s=10)
    entries = board.snapshot.remote().result()
    assert {e["role"] for e in entries} == {"context", "generation"}
    assert all(e["num_running"] == 0 and e["num_free_pages"] == e["num_total_pages"] for e in entries)


def test_metrics_show_pages_of_every_worker(disagg_url):
    assert wait_until(lambda: pages_all_free(disagg_url), timeout_s=20)
    free = metric_samples(disagg_url, "windserve_kv_pages_free")
    assert sorted(role for _, role in free) == ["context", "generation"]
    assert all(worker.startswith(("ContextWorker#", "GenerationWorker#")) for worker, _ in free)
    assert set(free.values()) == {2 * 128}  # two layer groups (sliding, full) of num_pages each
    empty = metric_samples(disagg_url, "windserve_kv_pages_empty")  # free and holding no cached block
    assert set(empty) == set(free) and all(0 <= empty[key] <= free[key] for key in free)
    moved = metric_samples(disagg_url, "windserve_kv_transfer_bytes_total")
    assert [role for _, role in moved] == ["generation"] and sum(moved.values()) > 0
    proposed = metric_samples(disagg_url, "windserve_spec_draft_tokens_proposed_total")
    accepted = metric_samples(disagg_url, "windserve_spec_draft_tokens_accepted_total")
    generation = next(key for key in proposed if key[1] == "generation")
    assert proposed[generation] > 0 and 0 <= accepted[generation] <= proposed[generation]  # the repetitive prompts
    assert httpx.get(f"{disagg_url}/health", timeout=10).status_code == 200


def handoff_counters(url: str) -> tuple[float, float, float, float]:
    """(KV pulls, KV bytes, transfer fallbacks, context fallbacks) of the app, summed over its workers."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    names = ("windserve_kv_transfers_total", "windserve_kv_transfer_bytes_total",
             "windserve_kv_transfer_fallbacks_total", "windserve_context_fallbacks_total")
    samples = [(s.name, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    return tuple(sum(value for name, value in samples if name == wanted) for wanted in names)


def settled_handoff_counters(url: str) -> tuple[float, float, float, float]:
    """``handoff_counters`` once the workers' stats reports (every second) have caught up."""
    latest = handoff_counters(url)
    for _ in range(10):
        time.sleep(1.5)
        previous, latest = latest, handoff_counters(url)
        if latest == previous:
            break
    return latest


def test_disaggregated_equals_aggregated(client, agg_client, agg_url, disagg_url):
    """Token for token, and every disaggregated request's KV was pulled (one pull each, bytes moved):
    a generation worker that prefilled locally instead would give the same text."""
    assert wait_until(lambda: in_flight(agg_url) == 0 and in_flight(disagg_url) == 0, timeout_s=20)
    before = settled_handoff_counters(disagg_url)
    for prompt in PROMPTS:
        disagg = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
        agg = agg_client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
        assert disagg.choices[0].text == agg.choices[0].text, prompt
    disagg = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, **GREEDY)
    agg = agg_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, **GREEDY)
    assert disagg.choices[0].message.content == agg.choices[0].message.content
    num_pulls, num_bytes, *fallbacks = (a - b for a, b in zip(settled_handoff_counters(disagg_url), before))
    assert (num_pulls, fallbacks) == (len(PROMPTS) + 1, [0, 0]) and num_bytes > 0


def test_each_ingress_calls_its_workers_over_its_transport_and_the_proxy_uses_grpc(base_url):
    """Both transports are served here, and test_disaggregated_equals_aggregated compares their tokens.
    Serve's proxy got SERVE_CONTROLLER_OPTIONS' variables (RAY_SERVE_PROXY_USE_GRPC among them) from the
    controller's options (tests.serving), so it reaches the ingress over gRPC too."""
    transports = {app: serve.get_deployment_handle("Ingress", app_name=app).worker_transports.remote()
                  .result(timeout_s=10) for app in ("disagg", "agg")}
    assert transports == {"disagg": {"context": "grpc", "generation": "grpc"}, "agg": {"aggregated": "ray"}}
    proxies = [p for p in psutil.process_iter(["cmdline"]) if "ray::ProxyActor" in " ".join(p.info["cmdline"] or [])]
    env_vars = SERVE_CONTROLLER_OPTIONS["runtime_env"]["env_vars"]
    assert env_vars["RAY_SERVE_PROXY_USE_GRPC"] == "1"
    assert proxies and all(p.environ().get(name) == value for p in proxies for name, value in env_vars.items())


def prefix_cache_tokens(url: str) -> dict[str, tuple[float, float]]:
    """role -> (prefix-cache queries, hits) in /metrics, summed over that role's workers."""
    queries = metric_samples(url, "windserve_prefix_cache_queries_total")
    hits = metric_samples(url, "windserve_prefix_cache_hits_total")
    return {role: (sum(v for (_, r), v in queries.items() if r == role),
                   sum(v for (_, r), v in hits.items() if r == role)) for _, role in queries}


def settled_prefix_cache_tokens(url: str, role: str) -> tuple[float, float]:
    """``prefix_cache_tokens`` once the workers' stats reports (every second) have caught up."""
    latest = prefix_cache_tokens(url).get(role)
    for _ in range(10):
        time.sleep(1.5)
        previous, latest = latest, prefix_cache_tokens(url).get(role)
        if latest == previous:
            break
    return latest


@pytest.mark.parametrize("mode", ["agg", "disagg"])
def test_a_repeated_prompt_reports_cached_tokens_and_counts_hits(mode, client, agg_client, disagg_url, agg_url,
                                                                 tokenizer):
    """The second time, the prompt's full blocks come from the prefix cache (the context side's
    hit when disaggregated): usage says so in OpenAI's field, and /metrics counts the lookups."""
    url, api = (agg_url, agg_client) if mode == "agg" else (disagg_url, client)
    role = "aggregated" if mode == "agg" else "context"
    prompt = f"{mode}: " + "the same long system prompt, sent twice. " * 3
    num_prompt_tokens = len(tokenizer.encode(prompt))
    assert num_prompt_tokens > 4 * ENGINE["tokens_per_block"]
    assert wait_until(lambda: in_flight(url) == 0, timeout_s=20)
    before = settled_prefix_cache_tokens(url, role)
    first = api.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY)
    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    second = chunks[-1].usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    block = ENGINE["tokens_per_block"]
    assert second.prompt_tokens_details.cached_tokens == (num_prompt_tokens - 1) // block * block > 0
    expected = (before[0] + 2 * num_prompt_tokens, before[1] + second.prompt_tokens_details.cached_tokens)
    assert wait_until(lambda: prefix_cache_tokens(url)[role] == expected, timeout_s=10), prefix_cache_tokens(url)



def test_engine_in_ingress_serves_the_aggregated_tokens_with_no_worker_deployment(agg_client, local_url):
    """/local's ingress is its own engine: the same greedy text as /agg's AggregatedWorker through the
    official client (completions, streamed chat), and its app has no worker deployment to hop through."""
    local = openai_client(local_url).with_options(timeout=60)
    for prompt in PROMPTS:
        ours = local.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
        theirs = agg_client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
        assert ours.choices[0].text == theirs.choices[0].text, prompt
        assert ours.usage.completion_tokens == 24
    chunks = local.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, stream=True, **GREEDY)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    agg = agg_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, **GREEDY)
    assert streamed == agg.choices[0].message.content
    deployments = serve.status().applications["local"].deployments
    assert set(deployments) == {"Ingress", "WorkerStats"}
    assert wait_until(lambda: pages_all_free(local_url), timeout_s=20)
    (worker, role), = metric_samples(local_url, "windserve_kv_pages_in_use")
    assert worker.startswith("Ingress#") and role == "aggregated"
    assert httpx.get(f"{local_url}/health", timeout=10).status_code == 200


def test_engine_in_ingress_disconnect_mid_stream_aborts_and_frees_its_pages(local_url):
    assert wait_until(lambda: pages_all_free(local_url), timeout_s=20)
    board = serve.get_deployment_handle("WorkerStats", app_name="local")
    cancelled_before = settled_cancellations(board)["aggregated"]
    leave_mid_stream(local_url, "aggregated")
    assert wait_until(lambda: pages_all_free(local_url), timeout_s=20)
    assert wait_until(lambda: settled_cancellations(board)["aggregated"] == cancelled_before + 1, timeout_s=30)
    (entry,) = board.snapshot.remote().result()
    assert entry["num_running"] == 0 and entry["num_free_pages"] == entry["num_total_pages"]
    assert in_flight(local_url) == 0
