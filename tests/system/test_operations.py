"""Operating a running stack: the status page in a real browser, the client, JSON logs."""

import json
import subprocess
import sys

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from tests.support import until


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--window-size=1400,900",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def client(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bootstrap.client", "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def table_rows(driver, table_id: str) -> list[list[str]]:
    """The rendered table, read in one script call: the page replaces its rows every second."""
    script = (
        "return [...document.querySelectorAll(arguments[0])].map(r => [...r.cells].map(c => c.innerText))"
    )
    return driver.execute_script(script, f"#{table_id} tbody tr")


def test_status_page_client_and_json_logs(stack, browser, tmp_path):
    json_logs = ["--log-format", "json"]
    _, decode = stack.start(json_logs, json_logs)
    url = stack.bootstrap.url
    browser.get(url + "/")
    assert browser.title == "kvroom status"
    until(
        lambda: (
            {(r[0], r[1], r[3]) for r in table_rows(browser, "nodes")}
            == {("prefill-0", "prefill", "alive"), ("decode-0", "decode", "alive")}
        ),
        20,
        "both nodes listed alive",
    )

    done = client(url, "submit", "--prompt", "seen in a browser", "--max-new-tokens", "8", "--wait", "30")
    assert done.returncode == 0, done.stderr
    assert "SUCCESS" in done.stdout
    room = done.stdout.splitlines()[2].split()[0]
    until(
        lambda: any(r[0] == room and r[1] == "SUCCESS" for r in table_rows(browser, "rooms")),
        20,
        "the room to appear SUCCESS on the page",
    )
    browser.save_screenshot(str(tmp_path / "status.png"))

    nodes = client(url, "nodes")
    assert nodes.returncode == 0 and "prefill-0" in nodes.stdout and "decode-0" in nodes.stdout
    listed = client(url, "rooms", "--state", "SUCCESS")
    assert listed.returncode == 0 and room in listed.stdout
    waited = client(url, "wait", room)
    assert waited.returncode == 0 and "SUCCESS" in waited.stdout
    assert client(url, "abort", room).returncode != 0  # already ended: 409, said plainly
    assert client(url, "wait", "12345").returncode != 0

    # One structured line per room transition, carrying the room id.
    lines = [json.loads(line) for line in decode.log_path.read_text().splitlines() if line.startswith("{")]
    transitions = [line["msg"].split()[1] for line in lines if line.get("room") == int(room)]
    assert transitions == ["BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING", "SUCCESS"]
