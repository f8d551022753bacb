"""The web page in a real browser: Debian's headless Chromium driven by Playwright, against a real
daemon (``serve --web`` on loopback, real workers), as a person uses it: sign in with the token
URL, generate on ``tiny`` and watch the progress, see the image in the gallery, download it, use
its settings again, cancel a long job; and a browser without the cookie gets nothing.

Playwright is pointed at /usr/bin/chromium (``launch(executable_path=...)``); its own browser
download is never used. Set DIFFUSIOND_SCREENSHOTS=DIR to keep screenshots of the page (the
README's come from there).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from daemonkit import Daemon, shared_daemon
from PIL import Image

CHROMIUM = Path(os.environ.get("DIFFUSIOND_CHROMIUM", "/usr/bin/chromium"))
if not CHROMIUM.exists():
    pytest.skip(f"no Chromium at {CHROMIUM}: `apt-get install chromium` (make test does it as root)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="no playwright: pip install -e '.[test]'")

HOLD_MODEL = "hold=synthetic:compute_ms=300000"  # computes until cancelled (test_daemon_lifecycle.py)
ENV = {"OMP_NUM_THREADS": "1"}
TIMEOUT_MS = 120_000  # a shared two-core machine: generous, and only ever reached by a failure
SHOTS = os.environ.get("DIFFUSIOND_SCREENSHOTS")


@pytest.fixture(scope="module")
def web_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, controlnet_dir: Path,
               ip_adapter_file: Path, upscaler_file: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("webpage")
    args = ["--model", "tiny", "--model", HOLD_MODEL, "--job-timeout", "120", "--web", "127.0.0.1:0",
            "--controlnet", f"edges={controlnet_dir}", "--controlnet", f"blobs={controlnet_dir}",  # two control rows
            "--ip-adapter", f"style={ip_adapter_file}",
            "--ip-adapter", f"look={ip_adapter_file}",  # a second name for the rows of references
            "--upscaler", f"esr={upscaler_file}"]
    with shared_daemon(tmp, args, model_cache, ENV) as d:
        yield d


@pytest.fixture(scope="module")
def union_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    """tiny-flux with a union ControlNet (controlkit's, 3 modes) whose modes serve names ``a``, ``b`` and ``c``:
    its own daemon, so the main one's models and their worker start stay as they are."""
    from controlkit import build_flux_controlnet

    tmp = tmp_path_factory.mktemp("webpage-union")
    union = build_flux_controlnet(tmp / "u", seed=8, num_mode=3)
    args = ["--model", "tiny-flux", "--job-timeout", "120", "--web", "127.0.0.1:0",
            "--controlnet", f"u={union},modes=a:b:c"]
    with shared_daemon(tmp, args, model_cache, ENV) as d:
        yield d


def web_url(d: Daemon) -> str:
    from diffusiond import Client

    with Client(str(d.socket)) as c:
        return c.web_url()


@pytest.fixture(scope="module")
def sign_in_url(web_daemon: Daemon) -> str:
    return web_url(web_daemon)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield b
        b.close()


@pytest.fixture
def context(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(accept_downloads=True, viewport={"width": 1200, "height": 860})
    ctx.set_default_timeout(TIMEOUT_MS)
    yield ctx
    ctx.close()


@contextmanager
def signed_in(context: Any, url: str) -> Iterator[Any]:
    """A signed-in page, ready (models listed); fails the test on any uncaught script error."""
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.goto(url)
    pg.wait_for_selector("body[data-ready=true]")
    yield pg
    assert errors == [], errors


@pytest.fixture
def page(context: Any, sign_in_url: str) -> Iterator[Any]:
    with signed_in(context, sign_in_url) as pg:
        yield pg


def shot(page: Any, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True)


def over_socket(d: Daemon, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """The daemon's own answer over its Unix socket (httpx: Playwright's sync API already runs an
    event loop in this thread, so no asyncio here)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)), base_url="http://diffusiond") as c:
        r = c.request(method, path, json=body)
    return r.status_code, r.json() if r.headers["Content-Type"].startswith("application/json") else r.content


def generated(page: Any, d: Daemon) -> tuple[str, dict[str, Any]]:
    """Generate from the filled form without previews, wait until the page says it succeeded, and return
    the job's id and the daemon's own record of it."""
    page.uncheck("#previews")
    invalid = page.evaluate("() => [...document.querySelectorAll('#form :invalid')].map(e => e.id)")
    assert invalid == [], f"the browser would not submit the form: {invalid} invalid"
    page.click("#generate")
    page.wait_for_function("() => document.getElementById('job-id').textContent.startsWith('j_')"
                           " || !document.getElementById('error').hidden")  # sent, or refused: say why
    assert page.is_hidden("#error"), page.inner_text("#error")
    job_id = page.inner_text("#job-id")
    page.wait_for_selector('#status[data-status="succeeded"]')
    status, job = over_socket(d, "GET", f"/v1/jobs/{job_id}")
    assert status == 200 and job["status"] == "succeeded", job
    return job_id, job


def fill(page: Any, **fields: str) -> None:
    for name, value in fields.items():
        page.fill(f"#{name}", value)


def test_sign_in_generate_on_tiny_watch_progress_then_gallery_download_and_reuse(
    page: Any, context: Any, web_daemon: Daemon, sign_in_url: str
) -> None:
    base = sign_in_url.split("/?token=")[0]
    assert page.url == f"{base}/"  # the token left the address bar (and the history)
    [cookie] = [c for c in context.cookies() if c["name"].startswith("diffusiond_token_")]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert page.locator("#model option").all_inner_texts() == ["tiny (text-to-image)", "hold (text-to-image)"]
    assert page.is_hidden("#loras")  # this daemon has none
    assert page.is_visible("#input-image")  # tiny edits images (image-to-image, inpainting)
    page.select_option("#model", "hold")
    assert page.is_hidden("#input-image")  # a synthetic model does not

    page.click("#dice")
    assert page.input_value("#seed").isdigit()
    page.select_option("#model", "tiny")
    fill(page, prompt="a lighthouse at dusk", negative="blurry", width="64", height="64", steps="30", seed="1234",
         guidance="6.5")
    page.press("#prompt", "Control+Enter")

    page.wait_for_function("() => Number(document.getElementById('progress').dataset.events) > 0")
    job_id = page.inner_text("#job-id")
    assert job_id.startswith("j_")
    card = f'article[data-job-id="{job_id}"]'
    page.wait_for_selector(f'{card}[data-status="succeeded"]')
    page.wait_for_function(f"() => document.querySelector('{card} img')?.naturalWidth === 64")
    assert page.get_attribute("#status", "data-status") == "succeeded"
    assert page.evaluate("() => document.getElementById('progress').value === document.getElementById('progress').max")
    meta = page.inner_text(card)
    assert "a lighthouse at dusk" in meta and "not: blurry" in meta
    for words in ("tiny", "64×64", "30 steps", "guidance 6.5", "seed 1234"):
        assert words in meta, (words, meta)
    shot(page, "web-page")

    with page.expect_download() as download:
        page.click(f"{card} a.download")
    assert download.value.suggested_filename == f"{job_id}-0.png"
    status, original = over_socket(web_daemon, "GET", f"/v1/jobs/{job_id}/outputs/0")
    assert status == 200 and Path(download.value.path()).read_bytes() == original

    fill(page, prompt="", negative="", width="", height="", steps="", seed="", guidance="")
    page.click(f"{card} button.reuse")
    assert [page.input_value(f"#{f}") for f in ("prompt", "negative", "width", "height", "steps", "seed", "guidance")] \
        == ["a lighthouse at dusk", "blurry", "64", "64", "30", "1234", "6.5"]
    assert page.input_value("#model") == "tiny"


def test_cancel_a_long_job_from_the_page(page: Any, web_daemon: Daemon) -> None:
    page.select_option("#model", "hold")
    fill(page, prompt="a job that computes until cancelled", width="64", height="64", steps="500", seed="")
    # a synthetic model shows no previews, as its /v1/models entry says: the page offers none
    assert page.is_disabled("#previews")
    assert page.get_attribute("label:has(#previews)", "title") == "hold shows no previews"
    page.click("#generate")
    page.wait_for_function("() => Number(document.getElementById('progress').dataset.events) > 0")
    job_id = page.inner_text("#job-id")
    assert page.is_enabled("#cancel") and page.is_disabled("#generate")  # one job at a time from the form
    shot(page, "web-page-running")
    page.click("#cancel")
    page.wait_for_selector('#status[data-status="cancelled"]')
    status, job = over_socket(web_daemon, "GET", f"/v1/jobs/{job_id}")
    assert status == 200 and job["status"] == "cancelled" and job["error"]["code"] == "cancelled"
    page.wait_for_selector(f'article[data-job-id="{job_id}"][data-status="cancelled"]')
    assert page.is_enabled("#generate") and page.is_disabled("#cancel")


def test_a_browser_without_the_cookie_is_refused(browser: Any, web_daemon: Daemon, sign_in_url: str) -> None:
    base = sign_in_url.split("/?token=")[0]
    ctx = browser.new_context()
    try:
        pg = ctx.new_page()
        pg.goto(f"{base}/")
        pg.wait_for_selector("#signin", state="visible")
        assert pg.is_hidden("#app")
        assert "diffusiond web-url" in pg.inner_text("#signin")
        shot(pg, "web-page-signed-out")
        prompt = "sent without the cookie"
        answer = pg.evaluate("""async (prompt) => {
            const r = await fetch('/v1/jobs', {method: 'POST', headers: {'Content-Type': 'application/json'},
                                               body: JSON.stringify({prompt, model: 'hold'})});
            return [r.status, (await r.json()).error.code];
        }""", prompt)
        assert answer == [401, "unauthorized"]
        listed = over_socket(web_daemon, "GET", "/v1/jobs")[1]["data"]
        assert [j for j in listed if j["request"]["prompt"] == prompt] == []
        # a wrong token in the URL signs nothing in
        pg.goto(f"{base}/?token=wrong")
        assert [c for c in ctx.cookies() if c["name"].startswith("diffusiond_token_")] == []
    finally:
        ctx.close()


def test_previews_appear_while_tiny_denoises(page: Any, web_daemon: Daemon) -> None:
    """Needs the previews half of issue 14 (SSE ``preview`` events); skipped while the daemon
    refuses the ``preview`` field, so it starts checking the day that work lands."""
    status, answer = over_socket(web_daemon, "POST", "/v1/jobs", {
        "model": "tiny", "prompt": "probe", "width": 64, "height": 64, "steps": 1,
        "preview": {"every": 1, "format": "jpeg", "max_side": 256}})
    if status == 400 and str(answer["error"].get("field", "")).startswith("preview"):
        pytest.skip("this daemon does not take the 'preview' field yet (previews, issue 14)")
    assert status == 202, answer
    page.select_option("#model", "tiny")
    fill(page, prompt="previews please", width="64", height="64", steps="100", seed="7")
    page.check("#previews")
    page.click("#generate")
    page.wait_for_function("() => Number(document.getElementById('preview').dataset.count) > 0")
    page.wait_for_function("() => document.getElementById('preview').naturalWidth > 0")  # a real image decoded
    assert page.is_visible("#preview")
    page.wait_for_selector('#status[data-status="succeeded"]')
    shot(page, "web-page-preview")


def test_the_residency_panel_shows_what_is_where_and_follows_a_move(page: Any, web_daemon: Daemon) -> None:
    """Each model's row: device, residency, bytes, keep-alive, pinned, queued/running; refreshed every
    few seconds from GET /v1/models, so a model unloaded by hand shows as off its device by itself."""
    rows = page.locator("#residency-rows tr")
    assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.model)")) == ["hold", "tiny"]
    tiny = '#residency-rows tr[data-model="tiny"]'
    page.wait_for_selector(f'{tiny}[data-residency="device"]')
    assert page.inner_text(f"{tiny} .device").endswith("iB"), "tiny's weights are on its device"
    assert page.inner_text(f"{tiny} .until") not in ("", "—")  # the default keep-alive: a time
    assert page.inner_text(f"{tiny} .pinned") == ""
    assert page.inner_text(f"{tiny} .queued") == "0" and page.inner_text(f"{tiny} .running") == "0"
    assert (page.inner_text(f"{tiny} .attention"), page.inner_text(f"{tiny} .approximations")) == ("default", "none")
    def post(path: str) -> int:  # a move may take longer than over_socket's 5 s (a load starts a worker)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(web_daemon.socket)), base_url="http://diffusiond",
                          timeout=120) as c:
            return c.post(path).status_code

    assert post("/v1/models/tiny/unload") == 200
    try:
        page.wait_for_selector(f'{tiny}[data-residency="disk"]', timeout=15_000)  # within a refresh or two
        assert page.inner_text(f"{tiny} .device") == "0" and page.inner_text(f"{tiny} .until") == "—"
        shot(page, "web-page-residency")
    finally:
        assert post("/v1/models/tiny/load") == 200


def a_png(path: Path, seed: int) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return path


def test_two_control_images_with_an_input_image_and_its_mask_inpaint_under_control(
    page: Any, web_daemon: Daemon, tmp_path: Path
) -> None:
    """ControlNets with an edit: two rows of the control box (each its ControlNet, picture, scale; one acting
    in part of the steps) and the input image with its mask on one form make an inpainting under both, in the
    rows' order; the other steer (no reference picture) sends nothing. The gallery card names both, and its
    "Use these settings" brings both rows back."""
    page.select_option("#model", "hold")
    assert page.is_hidden("#control") and page.is_hidden("#reference")  # a synthetic model takes neither
    page.select_option("#model", "tiny")
    assert page.is_visible("#control") and page.is_visible("#mask")
    assert page.locator("#control-name-0 option").all_inner_texts() == ["blobs", "edges"]
    assert page.is_hidden("#control-mode-box-0") and page.is_hidden("#control-remove-0")  # single-mode; one row
    page.click("#control-add")
    for k, (name, scale) in enumerate([("edges", "0.5"), ("blobs", "0.25")]):
        page.set_input_files(f"#control-image-{k}", str(a_png(tmp_path / f"map{k}.png", seed=3 + k)))
        page.select_option(f"#control-name-{k}", name)
        page.fill(f"#control-scale-{k}", scale)
    page.fill("#control-end-1", "0.5")
    page.set_input_files("#image", str(a_png(tmp_path / "input.png", seed=9)))
    Image.new("L", (64, 64), 255).save(tmp_path / "mask.png")  # white: repaint all of it
    page.set_input_files("#mask", str(tmp_path / "mask.png"))
    fill(page, prompt="a lighthouse, redrawn along the edges", width="64", height="64", steps="2", seed="5")
    page.fill("#strength", "0.5")
    job_id, job = generated(page, web_daemon)
    assert job["request"]["control"] == [
        {"name": "edges", "scale": 0.5, "start": 0.0, "end": 1.0, "preprocess": "none", "mode": None},
        {"name": "blobs", "scale": 0.25, "start": 0.0, "end": 0.5, "preprocess": "none", "mode": None}]
    assert (job["request"]["task"], job["request"]["strength"]) == ("inpainting", 0.5)
    assert job["request"]["ip_adapter"] == []
    card = f'article[data-job-id="{job_id}"]'
    page.wait_for_selector(card)
    assert "control edges:0.5 · control blobs:0.25[0-0.5]" in page.inner_text(card)
    shot(page, "web-page-control")
    page.click("#control-remove-1")
    page.select_option("#control-name-0", "blobs")
    page.click(f"{card} button.reuse")
    assert page.locator("#control-list .control").count() == 2
    rows = "#control-list .control:nth-child({}) [id^=control-{}]"
    assert [tuple(page.input_value(rows.format(k, f)) for f in ("name", "scale", "end")) for k in (1, 2)] \
        == [("edges", "0.5", "1"), ("blobs", "0.25", "0.5")]


def test_two_reference_images_go_from_the_page_into_the_job(page: Any, web_daemon: Daemon, tmp_path: Path) -> None:
    """Two rows of the reference box, each its own IP-Adapter, picture and scale, reach the job as two
    ``ip_adapter`` entries in the rows' order; the add button stops at the engine's cap of 4."""
    page.select_option("#model", "tiny")
    assert page.is_visible("#reference")
    assert page.locator("#reference-name-0 option").all_inner_texts() == ["look", "style"]
    assert page.is_hidden("#reference-remove-0")  # one row stays
    for _ in range(3):
        page.click("#reference-add")
    assert page.is_disabled("#reference-add") and page.locator("#reference-list .reference").count() == 4
    page.click("#reference-remove-3")
    page.click("#reference-remove-2")
    assert page.is_enabled("#reference-add") and page.locator("#reference-list .reference").count() == 2
    for k, (name, scale) in enumerate([("style", "0.5"), ("look", "0.25")]):
        page.set_input_files(f"#reference-image-{k}", str(a_png(tmp_path / f"reference{k}.png", seed=10 + k)))
        page.select_option(f"#reference-name-{k}", name)
        page.fill(f"#reference-scale-{k}", scale)
    fill(page, prompt="a lighthouse in two styles", width="64", height="64", steps="2", seed="5")
    job_id, job = generated(page, web_daemon)
    entries = job["request"]["ip_adapter"]
    assert [(e["name"], e["scale"]) for e in entries] == [("style", 0.5), ("look", 0.25)]
    assert entries[0]["image_digest"] != entries[1]["image_digest"]  # each row's own picture
    assert job["request"]["control"] == []
    card = f'article[data-job-id="{job_id}"]'
    page.wait_for_selector(card)
    assert "IP-Adapter style:0.5" in page.inner_text(card) and "IP-Adapter look:0.25" in page.inner_text(card)
    shot(page, "web-page-references")


def test_an_upscaler_chosen_on_the_page_upscales_the_job(page: Any, web_daemon: Daemon) -> None:
    """The upscale box lists the served upscaler (a 2x ESRGAN built in code) beside "none"; choosing it
    sends the job's ``upscale`` field, and the picture comes back at twice the asked size."""
    page.select_option("#model", "tiny")
    assert page.is_visible("#upscale")
    assert page.locator("#upscale-name option").all_inner_texts() == ["none", "esr (2x)"]
    page.select_option("#upscale-name", "esr")
    fill(page, prompt="a lighthouse, upscaled", width="64", height="64", steps="2", seed="9")
    job_id, job = generated(page, web_daemon)
    assert job["request"]["upscale"]["name"] == "esr"
    status, png = over_socket(web_daemon, "GET", job["outputs"][0]["url"])
    assert status == 200 and Image.open(io.BytesIO(png)).size == (128, 128)
    page.wait_for_selector(f'article[data-job-id="{job_id}"]')
    assert "upscale esr:" in page.inner_text(f'article[data-job-id="{job_id}"]')
    page.select_option("#upscale-name", "")  # back to none for the tests after this one
    shot(page, "web-page-upscale")


def test_a_union_controlnets_named_modes_are_picked_on_the_page_and_reach_the_job(
    context: Any, union_daemon: Daemon, tmp_path: Path
) -> None:
    """The control row of a union ControlNet served with ``modes=a:b:c`` shows a mode picker labelled with
    those names; the page asks for a mode before it sends, and the job made with ``b`` runs with mode 1."""
    with signed_in(context, web_url(union_daemon)) as page:
        page.select_option("#model", "tiny-flux")
        assert page.is_disabled("#negative")  # FLUX has no negative prompt: the page neither offers nor sends one
        page.evaluate("document.getElementById('negative').value = 'blurry'")  # as a reused SD job leaves it
        assert page.is_visible("#control") and page.is_visible("#control-mode-box-0")
        assert page.locator("#control-name-0 option").all_inner_texts() == ["u"]
        assert page.locator("#control-mode-0 option").all_inner_texts() == ["choose…", "0: a", "1: b", "2: c"]
        page.set_input_files("#control-image-0", str(a_png(tmp_path / "map.png", seed=4)))
        fill(page, prompt="a lighthouse in mode b", width="64", height="64", steps="2", seed="3")
        page.click("#generate")
        page.wait_for_selector("#error", state="visible")
        assert "Choose the mode of the union ControlNet u" in page.inner_text("#error")
        page.select_option("#control-mode-0", label="1: b")
        job_id, job = generated(page, union_daemon)
        assert [(c["name"], c["mode"]) for c in job["request"]["control"]] == [("u", 1)]
        assert not job["request"].get("negative_prompt"), job["request"]
        card = f'article[data-job-id="{job_id}"]'
        page.wait_for_selector(card)
        assert "control u@1:1" in page.inner_text(card)
        shot(page, "web-page-union")
