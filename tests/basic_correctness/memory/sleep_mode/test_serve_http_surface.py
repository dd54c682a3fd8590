"""The HTTP surface of a live `vllm serve` with graph offload and --api-key (GPU),
one server for every check: the key guards the dev routes, bad /collective_rpc
calls get an error answer and the server keeps serving, a repeated wake_up tag
is a 400 that changes nothing, and completions sent while the engine sleeps are
held and served after the wake (levels 1 and 2, staged wakes; after level 2 and
a full wake, only once the weights are reloaded), or refused with 503 and
Retry-After once the wait bound passes."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.utils import requires_gpu
from vllm_graph_sleep.testing import PROMPTS, model_dir

pytestmark = requires_gpu

KEY = "graph-sleep-test-key"
#: The server's VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S: long enough for the staged
#: wakes below, short enough that the 503 check costs little.
ASLEEP_WAIT_S = 10
#: A request that got no answer in this time counts as hung.
HUNG_S = 120
TOKENS = 24


class Http:
    def __init__(self, base_url: str, model: str):
        self.base_url = base_url
        self.model = model
        self.reference: list[list[int]] = []  # tokens before any sleep

    def __call__(self, method, path, body=None, key=KEY, timeout=HUNG_S):
        """(status, headers, JSON or None); never raises for an HTTP status."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = json.dumps(body).encode() if body is not None else b"" if method == "POST" else None
        request = urllib.request.Request(
            self.base_url + path, data=data, headers=headers, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, answer, raw = response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            status, answer, raw = error.code, error.headers, error.read()
        try:
            content = json.loads(raw) if raw else None
        except ValueError:
            content = raw.decode(errors="replace")
        return status, answer, content

    def tokens(self, **kwargs):
        body = {
            "model": self.model,
            "prompt": PROMPTS,
            "max_tokens": TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        status, headers, content = self("POST", "/v1/completions", body, **kwargs)
        if status != 200:
            return status, headers, content
        choices = sorted(content["choices"], key=lambda c: c["index"])
        return status, headers, [c["token_ids"] for c in choices]

    def in_background(self):
        """A completion on its own thread; join() gives (status, headers, tokens)."""
        result = {}
        thread = threading.Thread(target=lambda: result.update(answer=self.tokens()))
        thread.start()

        def join():
            thread.join(HUNG_S)
            assert not thread.is_alive(), f"a completion got no answer in {HUNG_S} s"
            return result["answer"]

        return thread, join


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from vllm_graph_sleep.bench.server import Server, free_port, serve_command, server_env

    port = free_port()
    command = serve_command(
        "ours",
        model_dir("llama"),
        port,
        tp=1,
        gpu_memory_utilization=0.25,
        max_model_len=512,
        extra=("--api-key", KEY),
    )
    env = server_env()
    env["VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S"] = str(ASLEEP_WAIT_S)
    log = Path(tmp_path_factory.mktemp("surface")) / "surface.server.log"
    server = Server("surface", command, env, log)
    server.start(f"http://127.0.0.1:{port}")
    try:
        server.wait_healthy(timeout=900)
        status, _, models = Http(server.base_url, "")("GET", "/v1/models")
        assert status == 200, models
        client = Http(server.base_url, models["data"][0]["id"])
        status, _, reference = client.tokens()
        assert status == 200, reference
        client.reference = reference
        yield client
    finally:
        server.stop()


def assert_awake_and_exact(http):
    assert http("GET", "/is_sleeping")[2] == {"is_sleeping": False}
    status, _, tokens = http.tokens()
    assert status == 200 and tokens == http.reference


GUARDED = [
    ("POST", "/sleep?level=1", None),
    ("POST", "/wake_up", None),
    ("GET", "/is_sleeping", None),
    ("POST", "/collective_rpc", {"method": "check_health"}),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/pause", None),
    ("GET", "/is_paused", None),
    ("GET", "/server_info", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/v1/completions", {"prompt": "hi"}),
]


def test_the_key_guards_the_dev_routes(http):
    for method, path, body in GUARDED:
        for key in (None, "wrong"):
            status, _, content = http(method, path, body, key=key)
            assert (status, content) == (401, {"error": "Unauthorized"}), (method, path, key)
    for path in ("/health", "/ping", "/version", "/metrics"):
        assert http("GET", path, key=None)[0] == 200, path
    # Nothing above reached the engine: still awake, same tokens.
    assert_awake_and_exact(http)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"method": "get_model"}, "cannot be sent back"),  # hung vLLM 0.26 for good
        ({"method": "no_such_worker_method"}, "no_such_worker_method"),
        ({"method": "load_model", "kwargs": {"no_such_argument": "1"}}, "no_such_argument"),
    ],
)
def test_bad_collective_rpc_is_an_error_answer_and_the_server_serves_on(http, body, says):
    started = time.monotonic()
    status, _, content = http("POST", "/collective_rpc", body)
    assert 400 <= status < 600 and time.monotonic() - started < HUNG_S
    assert says in json.dumps(content), content
    assert_awake_and_exact(http)


def test_completion_while_asleep_at_level_1_is_served_after_the_wake(http):
    assert http("POST", "/sleep?level=1")[0] == 200
    thread, join = http.in_background()
    time.sleep(2)
    assert thread.is_alive(), "answered while the engine slept"
    assert http("POST", "/wake_up")[0] == 200
    status, _, tokens = join()
    assert status == 200 and tokens == http.reference
    assert_awake_and_exact(http)


def test_completion_while_asleep_at_level_2_waits_for_the_last_staged_wake(http):
    assert http("POST", "/sleep?level=2")[0] == 200
    thread, join = http.in_background()
    assert http("POST", "/wake_up?tags=weights")[0] == 200
    status, _, content = http("POST", "/collective_rpc", {"method": "reload_weights"})
    assert status == 200, content
    time.sleep(1)
    assert thread.is_alive(), "answered before the KV cache woke"
    assert http("POST", "/wake_up?tags=kv_cache")[0] == 200
    status, _, tokens = join()
    assert status == 200 and tokens == http.reference
    assert_awake_and_exact(http)


def test_completion_after_level_2_and_a_full_wake_waits_for_the_reload(http):
    """The wake maps the weights back without their contents: stock vLLM would
    serve the completion on them."""
    assert http("POST", "/sleep?level=2")[0] == 200
    thread, join = http.in_background()
    assert http("POST", "/wake_up")[0] == 200
    time.sleep(1)
    assert thread.is_alive(), "answered before the weights were reloaded"
    status, _, content = http("POST", "/collective_rpc", {"method": "reload_weights"})
    assert status == 200, content
    status, _, tokens = join()
    assert status == 200 and tokens == http.reference
    assert_awake_and_exact(http)


def test_repeated_wake_up_tag_is_400_and_changes_nothing(http):
    """vLLM 0.26 woke the workers, then answered 500 and left scheduling paused."""
    assert http("POST", "/sleep?level=1")[0] == 200
    status, _, content = http("POST", "/wake_up?tags=weights&tags=weights")
    assert status == 400 and "given 2 times" in content["error"], content
    assert http("GET", "/is_sleeping")[2] == {"is_sleeping": True}
    assert http("POST", "/wake_up")[0] == 200
    assert_awake_and_exact(http)


@pytest.mark.parametrize("level", [1, 2])
def test_completion_while_asleep_past_the_bound_is_503(http, level):
    assert http("POST", f"/sleep?level={level}")[0] == 200
    started = time.monotonic()
    status, headers, content = http.tokens()
    waited = time.monotonic() - started
    assert status == 503 and headers["Retry-After"] == "1", content
    assert "asleep" in content["error"] and ASLEEP_WAIT_S <= waited < ASLEEP_WAIT_S + 10
    assert http("GET", "/is_sleeping")[2] == {"is_sleeping": True}
    assert http("POST", "/wake_up?tags=weights")[0] == 200
    if level == 2:
        assert http("POST", "/collective_rpc", {"method": "reload_weights"})[0] == 200
    assert http("POST", "/wake_up?tags=kv_cache")[0] == 200
    assert_awake_and_exact(http)
