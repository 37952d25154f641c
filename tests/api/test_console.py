"""The web console (/console) driven in headless Chromium (Debian's `chromium`, through Playwright)
against the real job server of tests/api (a queued job: this server runs no training, so curves and
trajectories are not covered here). Screenshots go to the test's tmp dir."""

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from apiserver import Server, Tenant

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
def browser() -> Iterator["sync_api.Browser"]:
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def _open(browser: "sync_api.Browser", server: Server, key: str) -> "sync_api.Page":
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(f"{server.url}/console/")
    page.fill("#key", key)
    page.click("text=Open")
    page.wait_for_selector("h1:has-text('Jobs')")
    return page


def test_console_lists_opens_and_cancels_a_job_and_hides_it_from_other_tenants(
    browser: "sync_api.Browser", server: Server, tenant: Tenant, other_tenant: Tenant, tmp_path: Path
) -> None:
    job = tenant.job(job_name="console-test")
    page = _open(browser, server, tenant.key)
    row = page.locator(f"tr.job[data-id='{job['id']}']")
    row.wait_for()
    assert "queued" in row.inner_text() and "console-test" in row.inner_text()
    page.screenshot(path=tmp_path / "jobs.png")

    row.click()
    page.wait_for_selector("#status")
    assert page.inner_text("#status") == "queued"
    assert '"job_name": "console-test"' in page.inner_text("pre")
    page.wait_for_selector("#events tr")  # the event stream's validating_files/queued events
    page.click("button[data-act='cancel']")
    page.wait_for_function("document.getElementById('status').textContent === 'cancelled'")
    assert tenant.http.get(f"/v1/opd/jobs/{job['id']}").json()["status"] == "cancelled"
    page.screenshot(path=tmp_path / "job.png")

    other = _open(browser, server, other_tenant.key)
    assert other.locator("tr.job").count() == 0
    assert job["id"] not in other.content()
    other.goto(f"{server.url}/console/#/job/{job['id']}")
    other.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "no job with id" in other.inner_text("#error")  # the API's own 404 message, as is
    assert "console-test" not in other.content()
    assert other_tenant.http.get(f"/v1/opd/jobs/{job['id']}").status_code == 404
    other.screenshot(path=tmp_path / "other_tenant.png")
