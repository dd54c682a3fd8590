"""With an API key, every route of vLLM's real app that is not public on purpose
needs the key (CPU: vLLM's build_app in dev mode, a test client, no engine)."""

from __future__ import annotations

import pytest
from fastapi.routing import APIWebSocketRoute
from fastapi.testclient import TestClient

from tests.unit.force_cpu_platform import force_cpu_platform
from vllm_graph_sleep.patches import entrypoints_serve_utils_server_utils as patch

KEY = "test-key"
OTHER_KEY = "second-key"


force_cpu_platform()


@pytest.fixture(scope="module", autouse=True)
def every_optional_router():
    # Dev mode and runtime LoRA add routes; both are read when the app is built.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        env.delenv("VLLM_API_KEY", raising=False)
        patch.apply()
        yield


def build(*cli: str):
    """vLLM's app with every router it can attach: all tasks, the profiler, the
    tokenizer-info and tokens-only routes, offline docs, plus the pooling routers
    (build_app adds those only with a pooling model's config)."""
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.entrypoints.pooling.classify.api_router import router as classify
    from vllm.entrypoints.pooling.embed.api_router import router as embed
    from vllm.entrypoints.pooling.pooling.api_router import router as pooling
    from vllm.entrypoints.pooling.scoring.api_router import router as scoring
    from vllm.tasks import GENERATION_TASKS, POOLING_TASKS
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    options = ["--model", "unused", "--tokens-only", "--enable-tokenizer-info-endpoint"]
    options += ["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/tmp"}']
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([*options, *cli])
    app = build_app(args, supported_tasks=(*GENERATION_TASKS, *POOLING_TASKS, "render"))
    for router in (pooling, classify, embed, scoring):
        app.include_router(router)
    return app


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every HTTP route; websocket routes as ("WS", path)."""
    found = set()
    for route in app.routes:
        if isinstance(route, APIWebSocketRoute):
            found.add(("WS", route.path))
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                found.add((method, route.path))
        if not hasattr(route, "methods") and not isinstance(route, APIWebSocketRoute):
            found.add(("MOUNT", route.path))  # /metrics' ASGI app, offline docs' files
    return sorted(found, key=lambda r: (r[1], r[0]))


def guarded(path: str) -> bool:
    from vllm.entrypoints.serve.utils import server_utils

    return path.startswith(server_utils.GUARDED_PREFIX)


@pytest.fixture(scope="module")
def app_routes(every_optional_router):
    return build("--api-key", KEY, "--enable-offline-docs")


def test_every_route_is_classified(app_routes):
    # Offline docs replace /redoc by /static; classify the routes of both apps.
    found = sorted(set(routes(app_routes)) | set(routes(build("--api-key", KEY))))
    assert len(found) > 60, found  # the dev, LoRA, pooling and profiler routers are in
    unclassified = [r for r in found if not guarded(r[1]) and r[1] not in patch.PUBLIC_PATHS]
    assert unclassified == [], (
        "vLLM has routes that are neither guarded nor public on purpose; add each to "
        "GUARDED_PATHS or PUBLIC_PATHS in vllm_graph_sleep/patches/"
        f"entrypoints_serve_utils_server_utils.py: {unclassified}"
    )
    both = [r for r in found if guarded(r[1]) and r[1] in patch.PUBLIC_PATHS]
    assert both == []
    # Each listed path is a real route (a stale entry would hide a rename).
    paths = {path for _, path in found}
    assert set(patch.PUBLIC_PATHS) <= paths
    assert [p for p in patch.GUARDED_PATHS if not any(q.startswith(p) for q in paths)] == []


def test_no_guarded_prefix_covers_a_public_route():
    from vllm.entrypoints.serve.utils import server_utils

    for public in patch.PUBLIC_PATHS:
        assert not public.startswith(server_utils.GUARDED_PREFIX), public


def test_stock_guards_none_of_the_dev_routes():
    # Why the patch exists: vLLM 0.26's own prefixes leave these open.
    stock = ("/v1", "/v2", "/inference")
    for path in ("/sleep", "/wake_up", "/collective_rpc", "/server_info", "/invocations"):
        assert path in patch.GUARDED_PATHS and not path.startswith(stock)


def call(client: TestClient, method: str, path: str, headers=None):
    path = path.replace("{adapter_name}", "a").replace("{response_id}", "r")
    return client.request(method, path, headers=headers or {})


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def guarded_http_routes(app):
    return [(m, p) for m, p in routes(app) if guarded(p) and m not in ("WS", "MOUNT")]


def test_guarded_routes_need_the_key(app_routes):
    client = TestClient(app_routes, raise_server_exceptions=False)
    checked = guarded_http_routes(app_routes)
    assert ("POST", "/sleep") in checked and ("POST", "/collective_rpc") in checked
    for method, path in checked:
        for headers in (None, bearer("wrong"), {"Authorization": KEY}, bearer("")):
            response = call(client, method, path, headers)
            assert response.status_code == 401, (method, path, headers)
            assert response.json() == {"error": "Unauthorized"}
        # With the key the request reaches vLLM's handler (which, with no engine
        # here, answers whatever it answers: anything but 401).
        assert call(client, method, path, bearer(KEY)).status_code != 401, (method, path)


def test_public_routes_need_no_key(app_routes):
    client = TestClient(app_routes, raise_server_exceptions=False)
    for path in ("/version", "/ping", "/metrics", "/openapi.json", "/docs", "/load", "/health"):
        assert client.get(path).status_code != 401, path


def test_several_keys_each_open_the_routes():
    # vLLM takes several keys as one --api-key with several values.
    client = TestClient(build("--api-key", KEY, OTHER_KEY), raise_server_exceptions=False)
    assert client.post("/sleep?level=1").status_code == 401
    for key in (KEY, OTHER_KEY):
        assert client.get("/is_sleeping", headers=bearer(key)).status_code != 401


def test_vllm_api_key_environment_variable(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", OTHER_KEY)
    client = TestClient(build(), raise_server_exceptions=False)
    assert client.post("/wake_up").status_code == 401
    assert client.post("/wake_up", headers=bearer(KEY)).status_code == 401
    assert client.get("/server_info", headers=bearer(OTHER_KEY)).status_code != 401


def test_root_path_is_honoured():
    client = TestClient(
        build("--api-key", KEY, "--root-path", "/api"),
        root_path="/api",
        raise_server_exceptions=False,
    )
    assert client.post("/api/collective_rpc", json={"method": "x"}).status_code == 401
    assert client.post("/api/sleep?level=1").status_code == 401
    authorized = client.get("/api/is_sleeping", headers=bearer(KEY))
    assert authorized.status_code != 401
    assert client.get("/api/version").status_code == 200


def test_without_a_key_nothing_is_guarded():
    app = build()
    client = TestClient(app, raise_server_exceptions=False)
    assert not any(m.cls.__name__ == "AuthenticationMiddleware" for m in app.user_middleware)
    for method, path in guarded_http_routes(app):
        assert call(client, method, path).status_code != 401, (method, path)


def test_apply_is_idempotent():
    from vllm.entrypoints.serve.utils import server_utils

    before = server_utils.GUARDED_PREFIX
    patch.apply()
    assert server_utils.GUARDED_PREFIX == before
    assert len(set(before)) == len(before)
