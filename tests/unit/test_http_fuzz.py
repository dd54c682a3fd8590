"""benchmarks/http_fuzz.py: its judgments, and a short run against the fake server
(which answers completions while asleep with 503 and Retry-After, as documented,
but validates nothing, so only the malformed-request checks may fail there)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests.utils import ROOT
from vllm_graph_sleep.bench.server import free_port

spec = importlib.util.spec_from_file_location("http_fuzz", ROOT / "benchmarks" / "http_fuzz.py")
fuzz = importlib.util.module_from_spec(spec)
sys.modules["http_fuzz"] = fuzz  # its dataclasses look their module up
spec.loader.exec_module(fuzz)

FAKE = ROOT / "tests" / "unit" / "fake_vllm_server.py"
#: What the fake server does not validate (vLLM with the plugin does).
FAKE_GAPS = {"bad_sleep", "bad_wake_up", "wrong_method", "invalid_utf8", "not_json"}
FAKE_GAPS |= {"no_method", "rpc_shape", "oversized", "bad_rpc"}


def judge(action: str, status: int | None, headers=None, body=b"{}", error=""):
    request = fuzz.Request(action, "POST", "/x")
    return fuzz.expected(request, fuzz.Answer(status, headers or {}, body, error))


@pytest.mark.parametrize(
    ("action", "status", "headers", "body", "ok"),
    [
        ("completion", 200, {}, b"{}", True),
        ("completion", 503, {"retry-after": "1"}, b"{}", True),
        ("completion", 503, {}, b"{}", False),  # a 503 must say when to retry
        ("completion", 500, {}, b"{}", False),
        ("sleep", 200, {}, b"", True),
        ("sleep", 500, {}, b"", False),
        ("wake_up", 400, {}, b"", False),
        ("bad_sleep", 400, {}, b"{}", True),
        ("bad_sleep", 200, {}, b"", False),
        ("oversized", 413, {}, b"", True),
        ("oversized", 500, {}, b"", False),
        ("bad_rpc", 500, {}, b'{"error": {"message": "x"}}', True),
        ("bad_rpc", 500, {}, b"Internal Server Error", False),
        ("bad_rpc", 502, {}, b"{}", False),
        ("no_key", 401, {}, b"{}", True),
        ("no_key", 200, {}, b"", False),
        ("is_sleeping", 200, {}, b'{"is_sleeping": true}', True),
        ("is_sleeping", 200, {}, b'{"is_sleeping": "yes"}', False),
    ],
)
def test_judgments(action, status, headers, body, ok):
    assert (judge(action, status, headers, body) is None) == ok


def test_no_answer_is_a_failure_whatever_the_action():
    assert "hang" in judge("completion", None, error="no answer in 5 s (hang)")


@pytest.fixture
def fake_server(tmp_path):
    port = free_port()
    command = [sys.executable, str(FAKE), "--port", str(port), "--config", "ours"]
    command += ["--used-file", str(tmp_path / "used")]
    log = open(tmp_path / "fake.log", "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    fuzzer = fuzz.Fuzzer(base_url, None, "fake-model", 0, 5)
    for _ in range(100):
        if fuzzer.send(fuzz.Request("setup", "GET", "/health", content_type=None)).status == 200:
            break
        time.sleep(0.1)
    yield base_url
    process.terminate()
    process.wait(10)
    log.close()


def test_short_run_against_the_fake_server(fake_server, tmp_path):
    out = tmp_path / "http.json"
    options = ["--out", str(out), "--base-url", fake_server, "--no-api-key", "--duration", "3"]
    code = fuzz.main([*options, "--clients", "4", "--hung-s", "10", "--model-id", "fake-model"])
    result = json.loads(out.read_text())
    assert result["requests"] > 20
    assert result["answers_by_action"]["completion"].keys() <= {"200", "503"}
    assert sum(result["answers_by_status"].values()) == result["requests"]
    assert result["final"] == {"awake": True, "tokens_exact": True}
    assert {f["action"] for f in result["failures"]} <= FAKE_GAPS
    assert code == (0 if result["passed"] else 1)
    assert result["failure_count"] == len(result["failures"]) or result["failure_count"] > 100


def test_a_client_that_dies_is_a_failure_not_a_pass(fake_server, monkeypatch):
    """Review, 2026-12-06: every client thread died and the run passed, 0 requests."""

    def broken(self, rng):
        raise RuntimeError("a bug in a request maker")

    monkeypatch.setattr(fuzz.Fuzzer, "random_request", broken)
    result = fuzz.Fuzzer(fake_server, None, "fake-model", 0, 5).run(0.5, 2)
    problems = [f["problem"] for f in result["failures"]]
    assert not result["passed"] and result["requests"] == 0
    assert "no request was made" in problems
    assert sum("a bug in a request maker" in p for p in problems) == 2


def test_a_server_that_never_gets_healthy_is_stopped(monkeypatch, tmp_path):
    """It was left running (its own session: Ctrl-C never reached it)."""
    import torch

    from vllm_graph_sleep.bench import server as bench_server

    started: list[bench_server.Server] = []

    def unhealthy(self, timeout, progress=None):
        started.append(self)
        raise bench_server.ServerError("not healthy")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_server.Server, "wait_healthy", unhealthy)
    monkeypatch.setattr(bench_server, "serve_command", lambda *args, **kwargs: ["sleep", "60"])
    with pytest.raises(bench_server.ServerError):
        fuzz.start_server(SimpleNamespace(model=str(tmp_path), api_key=None))
    assert started and started[0].process.poll() is not None
