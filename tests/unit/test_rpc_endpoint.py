"""POST /collective_rpc: a JSON body of the wrong shape is a 400 before vLLM's
handler runs; a valid body reaches the engine exactly as stock (CPU)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.entrypoints.serve.dev.rpc import api_router

from vllm_graph_sleep.patches import entrypoints_serve_dev_rpc_api_router as patch
from vllm_graph_sleep.patches._wrap import original_of
from vllm_graph_sleep.rpc_request_validation import RpcRequestValidation


class RecordingEngine:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, timeout, args, kwargs))
        return [{"ok": True}]


@pytest.fixture(autouse=True)
def dev_mode(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")


def serve(attach_router, root_path: str = ""):
    engine = RecordingEngine()
    app = FastAPI(root_path=root_path)
    attach_router(app)
    app.state.engine_client = engine
    return engine, TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def patched():
    patch.apply()
    return serve(api_router.attach_router)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"[1, 2]", "JSON object, not list"),
        (b"null", "JSON object, not NoneType"),
        (b'"check_health"', "JSON object, not str"),
        (b'{"method": 5}', '"method" must be a non-empty string'),
        (b'{"method": ""}', '"method" must be a non-empty string'),
        (b'{"method": "m", "args": "ab"}', '"args" must be a list'),
        (b'{"method": "m", "kwargs": [1]}', '"kwargs" must be an object'),
        (b'{"method": "m", "timeout": "abc"}', '"timeout" must be a number'),
        (b'{"method": "m", "timeout": -1}', '"timeout" must be a number'),
        (b'{"method": "m", "timeout": true}', '"timeout" must be a number'),
        (b'{"method": "m", "timeout": 1e999}', '"timeout" must be a number'),
        # vLLM's msgpack encoder would refuse it after queuing the call: a 500.
        (b'{"method": "m", "timeout": 18446744073709551616}', '"timeout" must be a number'),
    ],
)
def test_wrong_shape_is_400_before_the_engine(patched, body, says):
    engine, client = patched
    response = client.post("/collective_rpc", content=body)
    assert response.status_code == 400
    assert says in response.json()["error"]
    assert engine.calls == []


def test_stock_answers_some_of_them_500_or_calls_the_engine():
    engine, client = serve(original_of(api_router.attach_router))
    assert client.post("/collective_rpc", content=b"[1, 2]").status_code == 500
    assert client.post("/collective_rpc", content=b'{"method": 5}').status_code == 200
    assert engine.calls == [(5, None, (), {})]


@pytest.mark.parametrize(
    "body",
    [
        b'{"method": "check_health"}',
        b'{"method": "m", "args": ["a", 1], "kwargs": {"k": "v"}, "timeout": 2.5}',
        b'{"method": "m", "timeout": null}',
        b'{"method": "check_health", "kwargs": null}',  # vLLM's executors take it as {}
        b"{}",  # vLLM's own 400: missing method
        b"{not json",  # vLLM's own 400: JSON decode error
        b"{" + b"x" * (4 * 2**20),  # large, and not JSON: vLLM's own 400
    ],
)
def test_everything_else_answers_exactly_as_stock(body):
    patch.apply()
    answers = []
    for attach_router in (original_of(api_router.attach_router), api_router.attach_router):
        engine, client = serve(attach_router)
        response = client.post("/collective_rpc", content=body)
        answers.append((response.status_code, response.content, engine.calls))
    assert answers[0] == answers[1]
    assert answers[0][0] in (200, 400)


def test_root_path_and_other_routes(patched):
    patch.apply()
    engine, client = serve(api_router.attach_router, root_path="/api")
    assert client.post("/api/collective_rpc", content=b"[1]").status_code == 400
    response = client.post("/api/collective_rpc", json={"method": "check_health"})
    assert response.json() == {"results": [{"ok": True}]}
    assert client.get("/api/collective_rpc").status_code == 405
    assert engine.calls == [("check_health", None, (), {})]


def test_apply_and_attach_are_idempotent():
    patch.apply()
    wrapped = api_router.attach_router
    patch.apply()
    assert api_router.attach_router is wrapped
    app = FastAPI()
    api_router.attach_router(app)
    api_router.attach_router(app)
    assert sum(m.cls is RpcRequestValidation for m in app.user_middleware) == 1


def test_malformed_bodies_are_4xx_in_vllms_real_app():
    """Through vLLM's build_app (its exception handlers turn a body that is not
    UTF-8 into a 400 too); no engine is needed for any of these."""
    import vllm_graph_sleep
    from tests.unit.test_http_auth import build

    vllm_graph_sleep.register()
    patch.apply()
    app = build()
    app.state.engine_client = RecordingEngine()
    client = TestClient(app, raise_server_exceptions=False)
    for body in (b"[1, 2]", b"null", b'{"method": 5}', b'{"method": "\xff\xfe"}', b"", b"{x"):
        response = client.post("/collective_rpc", content=body)
        assert response.status_code == 400, (body, response.text)
    assert app.state.engine_client.calls == []
