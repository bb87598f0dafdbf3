"""The live page: `denpexd serve` draws a job at /jobs/<id> and the page follows the job.

A real `denpexd serve` (embedded broker, an API token) gets the first part of a recorded job's
events (its progress only); headless Chromium (Debian's package, driven by Playwright) opens
/jobs/<id>?token=… and shows a healthy job; then the rest of the job arrives and, without a
reload, the page shows the failure with the initiator's lane first and marked, as the API's
document says. No console error, no request off the daemon. The token is needed (401 without
it), the page is the document's version (304 when unchanged), and the job list links to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from denpex_agent.rules import RuleSet
from tests.integration.agent_harness import free_port
from tests.integration.replay import load_case, replay
from tests.integration.test_html_report import _expected_lanes as expected_lanes
from tests.integration.test_html_report import browser  # noqa: F401 - the shared Chromium fixture

pytestmark = [pytest.mark.integration]

TOKEN = "live-page-token-0123456789"


class Serve:
    def __init__(self, tmp: Path) -> None:
        self.http, self.mqtt = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
        self.log = (tmp / "serve.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "denpexd", "serve", "--http-listen", f"127.0.0.1:{self.http}",
             "--mqtt-listen", f"127.0.0.1:{self.mqtt}", "--data-dir", str(tmp / "data"), "--api-token", TOKEN],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("denpexd serve did not become ready")

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    def doc(self, job: str) -> dict[str, Any]:
        status, body, _ = self.get(f"/api/v1/jobs/{job}", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, body
        return dict(orjson.loads(body))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.log.close()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    s = Serve(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def _replay(events: list[Any], job: str, port: int, seq0: int = 0) -> None:
    """Publish in a thread of its own (Playwright's sync API holds this thread's event loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(
            asyncio.run, replay(events, job, host="127.0.0.1", port=port, speed=1000.0, v5=False, seq0=seq0)
        ).result(timeout=60)


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_live_page_follows_the_job(serve: Serve, browser: Any, library: RuleSet, tmp_path: Path) -> None:  # noqa: F811
    job = f"page-{uuid.uuid4().hex[:8]}"
    events = load_case("nan_fp16_skew", job, library)
    calm = [e for e in events if e.kind == "progress"]
    rest = [e for e in events if e.kind != "progress"]
    _replay(calm, job, serve.mqtt)
    _wait(
        lambda: serve.get(f"/api/v1/jobs/{job}", {"Authorization": f"Bearer {TOKEN}"})[0] == 200,
        20,
        "the job",
    )

    assert serve.get(f"/jobs/{job}")[0] == 401
    assert serve.get("/jobs")[0] == 401
    assert serve.get(f"/jobs/{job}?token=wrong")[0] == 401
    assert serve.get("/jobs/..%2Fetc?token=" + TOKEN)[0] in (400, 404)

    page = browser.new_page(viewport={"width": 1366, "height": 900})
    console: list[tuple[str, str]] = []
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: console.append((m.type, m.text)))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    try:
        page.goto(f"{serve.url}/jobs/{job}?token={TOKEN}", wait_until="load")
        main = page.locator("main")
        assert main.get_attribute("data-verdict") == "healthy"
        first_version = main.get_attribute("data-version")
        page.screenshot(path=str(tmp_path / "live-before.png"), full_page=True)

        _replay(rest, job, serve.mqtt, seq0=10_000)
        _wait(
            lambda: page.locator("main").get_attribute("data-verdict") == "failed",
            30,
            "the page to show the failure",
        )
        doc = serve.doc(job)
        main = page.locator("main")
        assert main.get_attribute("data-version") != first_version
        first = page.locator(".lanes .lane").first
        assert first.get_attribute("data-initiator") == "true"
        ini = doc["initiator"]
        assert (first.get_attribute("data-node"), first.get_attribute("data-rank")) == (
            ini["node"],
            str(ini["rank"]),
        )
        assert page.locator(".lanes .lane").count() == len(expected_lanes(doc))
        assert page.locator(".lane .mark.collateral").count() == len(doc["collateral"])
        shot = tmp_path / "live-after.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"\nlive page screenshots: {tmp_path / 'live-before.png'} {shot}")

        assert errors == [], errors
        assert [m for m in console if m[0] == "error"] == [], console
        assert all(u.startswith(serve.url) for u in requests), requests
        assert any("/jobs/" in u and "token" not in u for u in requests)  # the polls: by cookie
    finally:
        page.close()

    status, _, headers = serve.get(f"/jobs/{job}?token={TOKEN}")
    assert status == 200 and headers.get("Referrer-Policy") == "no-referrer"
    etag = headers["ETag"]
    assert serve.get(f"/jobs/{job}?token={TOKEN}", {"If-None-Match": etag})[0] == 304
    status, body, _ = serve.get(f"/jobs?token={TOKEN}")
    assert status == 200 and f'href="/jobs/{job}"'.encode() in body
