"""The playground page in a real browser, the stream client and the demo's probe steps, against one CPU server.

One fp32 server with the tiny SingProbe (test_probe_serving's fixture, shared), the gpt-oss parsers,
`--enable-playground` (patches/playground.py) and no radix cache: every request computes its prompt from
scratch, so two equal requests get equal scores to the last bit and the page's numbers can be compared
exactly with a direct SSE request's. The browser is Debian's headless Chromium driven by selenium
(packages `chromium` and `chromium-driver`, which launch/setup.sh installs); without them the browser
tests skip with one line naming the package. The page's screenshot is written to docs/playground.png.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import requests
from test_probe_serving import tiny_probe  # noqa: F401  (the module fixture, shared)

from sglang_ext.launch.demo import pick_threshold
from sglang_ext.launch.server import SGLangServer

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "playground.png"
# greedy on the tiny random model, this prompt gets mostly Latin-script tokens: the screenshot needs no CJK fonts
PROMPT = "Summarise the plot of Hamlet."
MAX_TOKENS = 32
LABEL = "label_8"
LABELS = [f"label_{i}" for i in range(10)]


BROWSER_PENDING = Path(__file__).resolve().parents[2] / ".cache" / "browser-install.pending"


def _wait_for_background_browser_install(timeout_s: float = 900) -> None:
    """launch/test.sh installs Chromium beside the first test files (launch/setup.sh --browser-in-background):
    wait while its marker names a live process."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = int(BROWSER_PENDING.read_text().strip() or 0)
            os.kill(pid, 0)
        except (OSError, ValueError):  # no marker, or its process is gone
            return
        time.sleep(2)


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, or a skip naming the missing package. Nothing is downloaded: selenium is given
    the driver's path and told to stay offline."""
    _wait_for_background_browser_install()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None:
        pytest.skip("needs the Debian package chromium (apt-get install chromium; launch/setup.sh installs it)")
    if driver is None:
        pytest.skip("needs the Debian package chromium-driver (apt-get install chromium-driver; launch/setup.sh)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must not fetch a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,860", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    drv = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture(scope="module")
def playground_server(tiny_checkpoints, tiny_probe, vocab_dir):  # noqa: F811
    args = ["--dtype", "float32", "--probe-ckpt", tiny_probe, "--reasoning-parser", "gpt-oss",
            "--tool-call-parser", "gpt-oss", "--enable-playground", "--disable-radix-cache"]
    with SGLangServer(tiny_checkpoints["fp32"], args, vocab_dir=vocab_dir) as srv:
        yield srv


def sse_stream(url, stop=None):
    from sglang_ext.launch.stream_client import stream_with_sse

    return stream_with_sse(url, "default", PROMPT, MAX_TOKENS, out=io.StringIO(), stop=stop)


def open_page(browser, url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url + "/playground")
    WebDriverWait(browser, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#colour-label option")) == 10)


def wait_for_end(browser, timeout=120):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, timeout).until(
        lambda d: d.find_element(By.ID, "status").get_attribute("data-state") in ("done", "error"))
    return browser.find_element(By.ID, "status").get_attribute("data-state")


def submit(browser, prompt):
    from selenium.webdriver.common.by import By

    box = browser.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    browser.find_element(By.ID, "send").click()


def set_input(browser, element_id, value):
    browser.execute_script(
        "const el = document.getElementById(arguments[0]); el.value = arguments[1];"
        "el.dispatchEvent(new Event('input')); el.dispatchEvent(new Event('change'));", element_id, str(value))


def test_page_shows_each_token_with_the_streams_scores_and_the_guard_stop(browser, playground_server):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    url = playground_server.url
    free = sse_stream(url)
    picked = pick_threshold([row[LABEL] for row in free], target=3 * len(free) // 4)
    assert picked is not None, [row[LABEL] for row in free]
    threshold, stop_at = picked
    guarded = sse_stream(url, stop={LABEL: threshold})
    assert guarded.finish_reason == "content_filter" and len(guarded) == stop_at + 1

    open_page(browser, url)
    assert browser.find_element(By.ID, "stop-label").get_attribute("value") == LABEL
    set_input(browser, "max-tokens", MAX_TOKENS)
    set_input(browser, "threshold", threshold)
    submit(browser, PROMPT)
    assert wait_for_end(browser) == "done", browser.find_element(By.ID, "message").text

    spans = browser.execute_script(
        "return [...document.querySelectorAll('span.tok')].map(s => ({index: Number(s.dataset.index),"
        " text: s.dataset.text, scores: s.dataset.scores, background: getComputedStyle(s).backgroundColor}))")
    spans.sort(key=lambda s: s["index"])
    assert [s["index"] for s in spans] == list(range(len(guarded)))
    assert [json.loads(s["scores"]) for s in spans] == list(guarded)  # exact: the same computation
    assert [s["text"] for s in spans] == [t.text for t in guarded.tokens]
    assert all(s["background"] not in ("", "transparent", "rgba(0, 0, 0, 0)") for s in spans)

    stop = browser.find_element(By.ID, "guard-stop")
    assert stop.is_displayed() and "content_filter" in stop.text, stop.text
    assert stop.get_attribute("data-label") == LABEL and stop.get_attribute("data-token") == str(stop_at)
    assert f"token {stop_at + 1}" in stop.text and f"threshold {threshold:g}" in stop.text, stop.text
    last = browser.find_element(By.CSS_SELECTOR, f"span.tok[data-index='{stop_at}']")
    assert "stopped" in last.get_attribute("class")
    assert browser.execute_script("return arguments[0].nextElementSibling.className", last) == "stop-mark"

    ActionChains(browser).move_to_element(last).perform()
    rows = browser.find_elements(By.CSS_SELECTOR, "#detail-body .score-row")
    assert len(rows) == 10 and LABEL in rows[8].text
    SCREENSHOT.parent.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(SCREENSHOT))


def fake_server(browser, info: dict, chunks: list, done: bool) -> None:
    """The page's next fetches of /playground/info and /v1/chat/completions answer `info` and an SSE body of
    `chunks` (ending in [DONE] if `done`): a probe-less server, a cut stream, channels the tiny model never uses."""
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ("data: [DONE]\n\n" if done else "")
    browser.execute_script("""
      const [info, body] = [arguments[0], arguments[1]];
      const real = window.fetch;
      window.fetch = async (url, options) => {
        if (url === '/playground/info') return new Response(info, {headers: {'Content-Type': 'application/json'}});
        if (url === '/v1/chat/completions') return new Response(body, {headers: {'Content-Type': 'text/event-stream'}});
        return real(url, options);
      };""", json.dumps(info), body)
    set_input(browser, "api-key", "")  # a changed key reloads /playground/info


def chunk(delta, token=None, scores=None, finish=None):
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if token is not None:
        choice["logprobs"] = {"content": [{"token": token}]}
    if scores is not None:
        choice["token_probe_probs"] = [scores]
    return {"choices": [choice]}


def test_page_says_what_is_wrong_never_blank(browser, playground_server):
    from selenium.webdriver.common.by import By

    open_page(browser, playground_server.url)
    submit(browser, "   ")
    assert "prompt is empty" in browser.find_element(By.ID, "message").text

    fake_server(browser, {"probe": False, "labels": [], "operator_probe_stop": {}},
                [chunk({"content": "Hello"}, token="Hello")], done=False)
    note = browser.find_element(By.ID, "probe-note")
    assert note.is_displayed() and "without a SingProbe" in note.text, note.text
    submit(browser, "hi")
    assert wait_for_end(browser) == "error"
    message = browser.find_element(By.ID, "message").text
    assert "cut the stream after 1 tokens" in message, message
    token = browser.find_element(By.CSS_SELECTOR, "#answer span.tok")
    assert token.text == "Hello" and token.get_attribute("data-scores") is None  # shown, not coloured


def test_page_keeps_reasoning_answer_and_tool_calls_apart(browser, playground_server):
    from selenium.webdriver.common.by import By

    open_page(browser, playground_server.url)
    row = {name: i / 10 for i, name in enumerate(LABELS)}
    fake_server(browser, {"probe": True, "labels": LABELS, "operator_probe_stop": {}}, [
        chunk({}, token="<|channel|>", scores=row),  # a marker the parser keeps: placed with the next text
        chunk({"reasoning_content": "Think"}, token="Think", scores=row),
        chunk({"content": "Hi"}, token="Hi", scores=row),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "get_weather", "arguments": '{"city"'}}]},
              token='{"city"', scores=row),
        chunk({}, finish="tool_calls"),
    ], done=True)
    submit(browser, "weather?")
    assert wait_for_end(browser) == "done", browser.find_element(By.ID, "message").text
    texts = browser.execute_script("return ['reasoning', 'answer', 'tools'].map(id => [...document.getElementById(id)"
                                   ".querySelectorAll('span.tok')].map(s => s.dataset.text))")
    assert texts == [["<|channel|>", "Think"], ["Hi"], ['{"city"']]
    assert "call get_weather" in browser.find_element(By.ID, "tools").text


def test_page_routes_and_their_auth(playground_server, monkeypatch):
    """The page's own files only; the page loads without a key, its info and generations do not."""
    url = playground_server.url
    page = requests.get(url + "/playground", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "playground.js" in page.text
    assert requests.get(url + "/playground/playground.js", timeout=30).status_code == 200
    for path in ("/playground/nope.js", "/playground/%2e%2e/pyproject.toml", "/playground/__init__.py"):
        assert requests.get(url + path, timeout=30).status_code == 404, path
    assert requests.get(url + "/playground/info", timeout=30).json() == {
        "probe": True, "labels": LABELS, "operator_probe_stop": {}}

    from sglang.srt.utils.auth import AuthDecision

    from sglang_ext.patches.playground import ENV_VAR, _page_without_key

    denied = AuthDecision(allowed=False)
    monkeypatch.setenv(ENV_VAR, "1")
    assert _page_without_key(denied, method="GET", path="/playground/playground.js").allowed
    assert not _page_without_key(denied, method="GET", path="/playground/info").allowed
    assert not _page_without_key(denied, method="POST", path="/playground").allowed
    monkeypatch.delenv(ENV_VAR)
    assert not _page_without_key(denied, method="GET", path="/playground").allowed


def test_stream_client_colours_tokens_and_reports_the_guard(playground_server, capsys):
    from sglang_ext.launch.stream_client import main

    url = playground_server.url
    assert main(["--base-url", url, "--max-tokens", "8", "--stop", f"{LABEL}=0", "--colour", "never", "hi"]) == 0
    out = capsys.readouterr().out
    assert "guard: stopped at token 1" in out and f"{LABEL} = " in out and "> threshold 0.0" in out, out
    assert "1 tokens, 1 scores, finish_reason content_filter" in out, out
    assert main(["--base-url", url, "--max-tokens", "6", "--reader", "sse", "--colour", "never", "hi"]) == 0
    out = capsys.readouterr().out
    tokens_line = out.splitlines()[0]
    assert tokens_line.count("\u203a") == 6 and "per-label maxima" in out and out.count(" max ") == 10, out
    assert main(["--base-url", url, "--label", "label_99", "hi"]) == 2
    assert "no label 'label_99'" in capsys.readouterr().err
    assert main(["--base-url", url, "--stop", "nope=0.5", "hi"]) == 1
    assert "unknown label(s) ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--stop", "label_8", "hi"])


def test_demo_probe_steps(playground_server, capsys):
    """Steps 3-5 of `bash launch/demo.sh` (the demo itself starts its own bf16 server)."""
    from sglang_ext.launch.demo import run_probe_steps

    assert run_probe_steps(playground_server.url, "default", MAX_TOKENS, LABELS) == 0
    out = capsys.readouterr().out
    assert "per-label maximum" in out and "finish_reason: content_filter" in out, out
    assert '"type": "content_filter"' in out and "largest difference between their scores" in out, out


def test_pick_threshold_lands_the_first_crossing_near_the_target():
    values = [0.2, 0.35, 0.5, 0.62, 0.9, 0.1]
    t, k = pick_threshold(values, target=3)
    assert k == 3 and max(values[:3]) < t < values[3]
    t, k = pick_threshold([0.9, 0.95], target=1)
    assert k == 1 and 0.9 < t < 0.95
    assert pick_threshold([0.5], target=0) is None  # a stop needs a token before it
