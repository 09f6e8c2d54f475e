"""The web dashboard at admission's ``/``, in a real headless Chromium driven by
Selenium, against a whole local cluster (embedded nats-server with its users and
permissions, admission, scheduler, predictor, emulated node agents).

The browser tests need Debian's ``chromium`` and ``chromium-driver`` (./scripts/test
installs them); without them they skip and say so."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.services.admission.dashboard import BUCKET_S, BUCKETS, count_per_bucket, job_id_floor
from gpusched.services.admission.ids import new_job_id
from gpusched.services.cli.up import LocalCluster, UpConfig

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
#: what the page shows follows the event stream within a second here; without it the
#: page polls every 10 s. Three polling periods bound every wait, so a page that only
#: polled would still pass on a slow machine and one that never updates fails.
PAGE_LIMIT_S = 30.0
#: the cluster's own start (a nats-server and four services) took 2-4 s here
START_LIMIT_S = 120.0
#: where test_the_dashboard_shows_shared_gpus_and_the_queue saves its screenshot when
#: GPUSCHED_DASHBOARD_SCREENSHOT=1 (docs/dashboard.md shows it)
SCREENSHOT = ROOT / "docs" / "dashboard.png"
XSS_NAME = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'


# ---------------------------------------------------------------------- pure parts


@given(
    st.lists(st.floats(min_value=-10_000, max_value=10_000, allow_nan=False)),
    st.floats(min_value=0, max_value=1e9, allow_nan=False),
)
def test_submission_counts_hold_every_time_of_the_last_hour_in_its_own_minute(
    offsets: list[float], end: float
):
    times = [end + offset for offset in offsets]
    counts = count_per_bucket(times, end)
    assert len(counts) == BUCKETS
    bounds = [end - BUCKET_S * (BUCKETS - i) for i in range(BUCKETS)] + [end]
    assert counts == [
        sum(bounds[i] <= t < bounds[i + 1] for t in times) for i in range(BUCKETS)
    ]


@given(st.floats(min_value=0, max_value=4_102_444_800), st.floats(min_value=0, max_value=1e6))
def test_every_job_id_made_at_or_after_a_time_sorts_above_that_times_floor(
    at: float, later: float
):
    assert new_job_id(at + later) > job_id_floor(at)


# ---------------------------------------------------------------------- a live cluster


class Running:
    """A LocalCluster on an event loop of its own thread, so the synchronous browser
    driver never blocks the services."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.url = ""
        self.token = ""
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="dashboard-cluster")

    def __enter__(self) -> Running:
        self._thread.start()
        if not self._ready.wait(START_LIMIT_S):
            raise AssertionError(f"the cluster did not start in {START_LIMIT_S} s")
        if self._failure is not None:
            raise self._failure
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(START_LIMIT_S)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with LocalCluster(self.config) as cluster:
                self.url, self.token = cluster.url, cluster.token
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._ready.set()

    # ------------------------------------------------------------------ the HTTP API

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             token: str | None = "") -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token or self.token}"
        request = urllib.request.Request(
            f"{self.url}{path}", method=method, headers=headers,
            data=json.dumps(body).encode() if body is not None else None,
        )
        try:
            with urllib.request.urlopen(request, timeout=PAGE_LIMIT_S) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def submit(self, **spec: Any) -> str:
        body = {"batch_size": 32, "iterations": 10_000_000, **spec}
        status, _, answer = self.call("POST", "/v1/jobs", body)
        assert status == 201, answer
        return str(json.loads(answer)["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        status, _, answer = self.call("GET", f"/v1/jobs/{job_id}")
        assert status == 200, answer
        return dict(json.loads(answer))


@pytest.fixture
def cluster_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[
    Callable[..., Running]
]:
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    started: list[Running] = []

    def start(**settings: Any) -> Running:
        config = UpConfig(port=0, state_dir=tmp_path / "state", time_scale=1.0,
                          heartbeat_s=0.2, **settings)
        running = Running(config).__enter__()
        started.append(running)
        return running

    yield start
    for running in started:
        running.__exit__()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(
            f"no {' and '.join(missing)}: install Debian's chromium and chromium-driver "
            "(./scripts/test does)"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--window-size=1500,1100",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, check: Callable[[Any], Any], what: str) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, PAGE_LIMIT_S, poll_frequency=0.05).until(check)
    except TimeoutException:
        raise AssertionError(f"the page never showed {what}") from None


def css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def text(driver: Any, selector: str) -> str | None:
    """The text of the first element matching ``selector`` (None: none), read in one
    step: the page replaces its rows as events arrive, so an element found a moment ago
    may be gone."""
    value = driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
        selector,
    )
    return None if value is None else str(value)


def click(driver: Any, selector: str) -> None:
    assert driver.execute_script(
        "const e = document.querySelector(arguments[0]); if (e) e.click(); return !!e;",
        selector,
    ), selector


def sign_in(driver: Any, cluster: Running, token: str | None = None) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{cluster.url}/")
    field = driver.find_element(By.ID, "token")
    field.send_keys(token or cluster.token)
    field.submit()


def live(driver: Any) -> None:
    wait_for(
        driver,
        lambda d: d.find_element("id", "connection").text == "live",
        "the event stream connected",
    )


# ---------------------------------------------------------------------- the page


def test_a_job_submitted_through_the_api_moves_on_the_page_from_the_queue_to_its_gpu(
    cluster_of, browser
):
    cluster = cluster_of(nodes=1, gpus_per_node=2, policy="fifo")
    sign_in(browser, cluster)
    live(browser)
    assert browser.execute_script("return sessionStorage.getItem('gpusched.token')") \
        == cluster.token
    wait_for(browser, lambda d: d.find_element("id", "policy").text == "fifo", "the policy")
    assert browser.find_element("id", "leader").text not in ("", "–", "none")

    blocker = cluster.submit(name="blocker", model="resnet50", gpus=2)
    wait_for(browser, lambda d: css(d, f'#running-body tr[data-job-id="{blocker}"]'),
             "the blocker running")
    waiting = cluster.submit(name="waits-for-a-gpu", model="resnet18", gpus=1)
    row = wait_for(browser, lambda d: text(d, f'#queue-body tr[data-job-id="{waiting}"]'),
                   "the second job in the queue")
    assert "waits-for-a-gpu" in row
    reason = cluster.job(waiting)["pending_reason"]
    assert reason
    wait_for(browser, lambda d: reason in d.find_element("id", "queue-body").text,
             f"the pending reason {reason!r}")

    status, _, _ = cluster.call("DELETE", f"/v1/jobs/{blocker}")
    assert status == 202
    cancelled_at = time.monotonic()
    wait_for(browser, lambda d: css(d, f'#running-body tr[data-job-id="{waiting}"]'),
             "the second job running")
    shown_after_s = time.monotonic() - cancelled_at
    placement = cluster.job(waiting)["placement"]
    assert cluster.job(waiting)["state"] == "RUNNING"
    [(node, index)] = [(p["node"], g) for p in placement for g in p["gpus"]]
    chip = f'.gpu[data-node="{node}"][data-gpu="{index}"] .job-chip[data-job-id="{waiting}"]'
    wait_for(browser, lambda d: css(d, chip), f"the job on {node} GPU {index}")
    assert not css(browser, f'#queue-body tr[data-job-id="{waiting}"]')
    wait_for(browser, lambda d: css(d, f'#finished-body tr[data-job-id="{blocker}"]'),
             "the cancelled blocker among the finished")

    click(browser, f'#running-body a[data-job-id="{waiting}"]')
    history = wait_for(
        browser, lambda d: (h := text(d, "#history")) and "RUNNING" in h and h,
        "the job's history",
    )
    assert "QUEUED" in history and "submitted" in history
    print(f"queued -> running shown {shown_after_s:.2f} s after the blocker's cancel")


def test_the_dashboard_shows_two_jobs_sharing_a_gpu_and_counts_submissions(
    cluster_of, browser
):
    cluster = cluster_of(nodes=2, gpus_per_node=2, policy="sjf-ffs")
    sign_in(browser, cluster)
    live(browser)
    jobs = [
        cluster.submit(name="resnet18-a", model="resnet18", gpus=2),
        cluster.submit(name="ncf-b", model="ncf", gpus=1),
        cluster.submit(name="resnet18-c", model="resnet18", gpus=1),
        cluster.submit(name="ncf-d", model="ncf", batch_size=64, gpus=1),
        cluster.submit(name="bert-wide", model="bert", gpus=4, allow_sharing=False),
    ]
    wait_for(browser, lambda d: text(d, ".gpu.shared"), "a shared GPU")
    shared = browser.execute_script(
        "return [...document.querySelectorAll('.gpu.shared')].map((g) => [g.dataset.node, "
        "+g.dataset.gpu, [...g.querySelectorAll('.job-chip')].map((c) => c.dataset.jobId)]);"
    )
    records = {job_id: cluster.job(job_id) for job_id in jobs}
    for node, index, on_gpu in shared:
        assert len(on_gpu) == 2
        assert sorted(on_gpu) == sorted(
            job_id for job_id, r in records.items()
            if any(p["node"] == node and index in p["gpus"] for p in r["placement"])
        )
    assert "shared" in (text(browser, ".gpu.shared .badge") or "")
    wait_for(
        browser,
        lambda d: d.find_element("id", "throughput-total").text.startswith("(5 in the last"),
        "five submissions in the last hour",
    )
    bars = css(browser, "#throughput .bar")
    assert len(bars) == BUCKETS
    if os.environ.get("GPUSCHED_DASHBOARD_SCREENSHOT"):
        queued = [j for j, r in records.items() if r["state"] == "QUEUED"]
        if queued:
            click(browser, f'#queue-body a[data-job-id="{queued[0]}"]')
            wait_for(browser, lambda d: text(d, "#history"), "the detail")
        time.sleep(2)  # let a few progress events fill the bars for the picture
        browser.save_screenshot(str(SCREENSHOT))


def test_job_provided_text_renders_as_text_and_runs_nothing(cluster_of, browser):
    cluster = cluster_of(nodes=1, gpus_per_node=1, policy="fifo")
    sign_in(browser, cluster)
    live(browser)
    job_id = cluster.submit(
        name=XSS_NAME, model="resnet18", labels={"<b>team</b>": '"><script>alert(1)</script>'}
    )
    wait_for(browser, lambda d: text(d, f'#running-body tr[data-job-id="{job_id}"]'),
             "the job running")
    assert text(browser, f'#running-body tr[data-job-id="{job_id}"] .name') == XSS_NAME
    click(browser, f'#running-body a[data-job-id="{job_id}"]')
    detail = wait_for(browser, lambda d: (t := text(d, "#detail-body")) and "labels" in t and t,
                      "the job's labels")
    assert '<b>team</b>="><script>alert(1)</script>' in detail
    chip = wait_for(browser, lambda d: text(d, f'.job-chip[data-job-id="{job_id}"]'),
                    "the job on its GPU")
    assert XSS_NAME in chip
    assert browser.execute_script("return window.__xss === undefined")
    assert not css(browser, "main img, main script")
    # the page's own bold text is the node names alone
    assert browser.execute_script(
        "return [...document.querySelectorAll('main b')].map((b) => b.textContent);"
    ) == ["node-0"]


def test_data_routes_refuse_a_missing_token_and_the_page_needs_none(cluster_of, browser):
    cluster = cluster_of(nodes=1, gpus_per_node=1, policy="fifo")
    for path in ("/v1/dashboard/scheduler", "/v1/dashboard/submissions",
                 "/v1/dashboard/events", "/v1/cluster", "/v1/jobs"):
        status, headers, _ = cluster.call("GET", path, token=None)
        assert status == 401, path
        assert headers["WWW-Authenticate"].startswith("Bearer")
        status, _, _ = cluster.call("GET", path, token="not-the-token")
        assert status == 401, path
    for path, kind in (("/", "text/html"), ("/dashboard.js", "text/javascript"),
                       ("/dashboard.css", "text/css")):
        status, headers, body = cluster.call("GET", path, token=None)
        assert status == 200 and headers["Content-Type"].startswith(kind), path
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert body
    deadline = time.monotonic() + PAGE_LIMIT_S
    while time.monotonic() < deadline:
        status, _, body = cluster.call("GET", "/v1/dashboard/scheduler")
        assert status == 200
        view = json.loads(body)
        if view["policy"] is not None:
            break
        time.sleep(0.1)
    assert view["policy"] == "fifo" and view["leader"]

    sign_in(browser, cluster, token="not-the-token")
    wait_for(browser, lambda d: d.find_element("id", "login-error").text
             == "the token was refused", "the refusal")
    assert not browser.find_element("id", "board").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('gpusched.token')") is None
    assert "not-the-token" not in browser.current_url
