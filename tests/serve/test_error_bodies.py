"""What a client reads in an error body: never a traceback, a source path or an exception's
internals; the server's log has those. Unit tests of the sanitizer (launch/serve/errors.py)
and of the catch-all 500, on an app in this process (no engine)."""

from __future__ import annotations

import asyncio
import logging
import re

import httpx
import pytest
from fastapi import FastAPI

from launch.serve.errors import (
    MAX_DETAIL_CHARS,
    death_cause,
    engine_dead,
    error_body,
    install_error_handlers,
    public_detail,
)

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/home/ci/tandem/workers/worker.py", line 362, in run\n'
    "    self.step(plan)\n"
    '  File "/usr/lib/python3.12/site-packages/torch/nn/modules/module.py", line 1553, in f\n'
    "    return forward_call(*args)\n"
    "RuntimeError: injected fault\n"
)
# an absolute path anywhere: what none of the bodies below may carry
ABS_PATH = re.compile(r"(?:^|[\s\"'(=:])/[\w.@~-]+/")


def leaks(text: str) -> list[str]:
    found = [s for s in ("Traceback", 'File "', ".py") if s in text]
    return found + ABS_PATH.findall(text)


def test_public_detail_cuts_tracebacks_and_source_paths() -> None:
    raw = f"worker rank 1 failed: RuntimeError: injected fault\n{TRACEBACK}"
    assert public_detail(raw) == "worker rank 1 failed: RuntimeError: injected fault"
    inline = 'boom at /srv/app/launch/serve/chat.py:41 (File "/srv/x.py", line 3, in f)'
    shown = public_detail(inline)
    assert not leaks(shown), shown
    assert shown.startswith("boom at <source>")
    # a whole dump is bounded, whatever it holds
    assert len(public_detail("x" * 100_000)) <= MAX_DETAIL_CHARS + 4
    assert public_detail(TRACEBACK) == "the request failed"
    assert public_detail("") == "the request failed"


def test_public_detail_keeps_client_errors_as_they_are() -> None:
    for msg in ("prompt is empty: at least one token is needed",
                "token id 512 is outside the vocabulary [0, 512)",
                "messages[0].content: string holds a lone surrogate ('\\ud800' at position 0)",
                "worker rejected the request: ValueError: bad bias",
                "lora_path: no adapter_config.json in /models/adapters/a1",
                "top_p must be in (0, 1]"):
        assert public_detail(msg) == msg


@pytest.mark.parametrize(("reason", "cause"), [
    (f"worker rank 1 failed: RuntimeError: injected fault\n{TRACEBACK}",
     "a worker process failed"),
    ("engine process worker rank 0 (pid 4242) killed by SIGKILL", "a worker process failed"),
    ("worker rank 1 (pid 77) died; worker rank 0 failed: connection closed",
     "a worker process failed"),
    (f"engine core crashed: KeyError: 3\n{TRACEBACK}", "the engine core process failed"),
    ("engine process engine core (pid 9) exited with code 1", "the engine core process failed"),
    ("undecodable message from the engine core: truncated frame",
     "the engine core sent a message the server could not read"),
    ("rank 0, 1 has not responded for 30.2 s (worker_timeout_s=30.0); a rank hung",
     "a worker process stopped responding"),
    ("something new", "the engine stopped"),
    (None, "the engine stopped"),
])
def test_death_cause(reason: str | None, cause: str) -> None:
    assert death_cause(reason) == cause


def test_engine_dead_is_short_and_logs_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    reason = f"worker rank 3 failed: RuntimeError: once only\n{TRACEBACK}"
    with caplog.at_level(logging.ERROR, logger="tandem.serve"):
        err = engine_dead(reason)
        engine_dead(reason)  # every request sees the same reason; the log needs it once
    assert err.status == 503
    assert err.message.startswith("the engine is dead: a worker process failed")
    assert not leaks(err.message), err.message
    logged = [r.getMessage() for r in caplog.records if "once only" in r.getMessage()]
    assert len(logged) == 1 and "Traceback" in logged[0]


def test_error_body_never_carries_a_traceback() -> None:
    body = error_body(500, f"something broke\n{TRACEBACK}")
    assert body["error"]["message"] == "something broke"
    assert not leaks(str(body))


def test_unexpected_exception_is_a_bare_500(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret at /srv/tandem/launch/serve/app.py line 9")

    async def get() -> httpx.Response:
        # the app re-raises after answering (Starlette's outermost middleware): not our client's
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/boom")

    with caplog.at_level(logging.ERROR, logger="tandem.serve"):
        r = asyncio.run(get())
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "InternalServerError" and err["code"] == 500
    assert "secret" not in r.text and "RuntimeError" not in r.text and not leaks(r.text)
    # the log has all of it: where, what, and the traceback
    rec = next(r for r in caplog.records if r.name == "tandem.serve")
    assert "/boom" in rec.getMessage() and rec.exc_info is not None
