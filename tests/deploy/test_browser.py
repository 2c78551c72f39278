"""The checkpoints of a deployed run, as a user sees them in the Prefect UI (headless Chromium).

The UI is a single-page app that fetches its data after loading, so the test
drives a real browser (tests/deploy/browser.py) and polls the rendered text:
the flow run page (its Artifacts tab lists the run's checkpoint table and the
store's latest checkpoint), the checkpoint table itself (one row per committed
epoch, sizes human-readable) and the store's latest-checkpoint card. Each page
is kept as a screenshot in tests/output/.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.reporting.chart import PANEL, WIDTH
from ckptflow.tasks.reporting.formatting import human_size, metric_value
from ckptflow.tasks.reporting.monitoring import slug, store_key, table_card_text
from tests.deploy.browser import CHROMIUM, Browser
from tests.deploy.helpers import run_artifact

pytestmark = pytest.mark.deploy

OUTPUT = Path(__file__).resolve().parents[1] / "output"


@pytest.fixture(scope="module")
def browser():
    assert shutil.which(CHROMIUM), "chromium is not installed: apt-get install -y chromium (.ci/run does)"
    with Browser(width=1600, height=1600) as b:  # the width the clipping was seen at
        yield b


@pytest.fixture(scope="module")
def store(trained):
    return CheckpointStore(str(trained.storage))


def test_flow_run_page_lists_the_checkpoint_artifacts(browser, stack, trained, store):
    browser.open(f"{stack.ui}/runs/flow-run/{trained.run_id}")
    page = browser.wait_for_text(trained.name, "Completed", "Artifacts")
    assert trained.name in page and "Completed" in page, page[:2000]
    assert browser.click_text("Artifacts"), page[:2000]
    run_table = f"ckptflow-{slug(trained.name)}-checkpoints"
    latest = f"{store_key(store.url)}-latest"
    described = table_card_text(store.versions())
    page = browser.wait_for_text(run_table, latest, described)
    browser.screenshot(OUTPUT / "deploy-flow-run-artifacts.png")
    assert run_table in page and latest in page and described in page, page[:3000]
    assert page.count(run_table) == 1  # one card per key, however many commits
    # Bug: every card's description was cut off (a store path in one line of 280 px)
    assert clipped(browser) == []


def test_flow_run_page_logs_each_commit(browser, stack, trained, store):
    """The run page's Logs tab (it updates as lines come; artifact pages do not) says each commit
    and where the run stands."""
    browser.open(f"{stack.ui}/runs/flow-run/{trained.run_id}")
    newest = store.latest()
    assert newest is not None
    line = f"committed version {newest.version} (epoch {newest.epoch}, "
    page = browser.wait_for_text(line, f"epoch {newest.epoch}/{newest.epoch}: ")
    browser.scroll_to(line)
    time.sleep(0.5)
    browser.screenshot(OUTPUT / "deploy-flow-run-page.png")
    assert line in page, page[:3000]
    # an epoch's line comes before its own save; the async save before it may still be in flight
    assert re.search(
        rf"epoch {newest.epoch}/{newest.epoch}: [^;]*; last commit v\d+ \(epoch \d+\) \d+ s ago", page
    ), page


def test_event_feed_shows_the_epoch_of_each_commit(browser, stack, trained, store):
    """Prefect's event feed shows a resource by its id (the V1 UI, the one served by default) or by
    its name (V2): both carry the version and the epoch, not just the store's path."""
    browser.open(f"{stack.ui}/events")
    ids = [f"/v{v.version:06d} epoch {v.epoch}" for v in store.versions()]
    page = browser.wait_for_text(*ids)
    browser.scroll_to(ids[-1])
    time.sleep(0.5)
    browser.screenshot(OUTPUT / "deploy-event-feed.png")
    assert all(i in page for i in ids), page[:3000]


def test_checkpoint_table_shows_every_committed_epoch(browser, stack, trained, store):
    table = run_artifact(trained.run_id, f"ckptflow-{slug(trained.name)}-checkpoints")
    versions = store.versions()
    browser.open(f"{stack.ui}/artifacts/artifact/{table.id}")
    page = browser.wait_for_text(*(v.url for v in versions))
    browser.screenshot(OUTPUT / "deploy-checkpoint-table.png")
    assert clipped(browser) == []  # the URL column, the dates
    header = "epoch version loss val_loss val_acc size save seconds throughput committed url"
    assert header in page, page[:3000]
    for v in versions:
        # a row: epoch, version, each metric in its own column, human-readable size, ..., URL
        values = " ".join(metric_value(v.metrics[name]) for name in ("loss", "val_loss", "val_acc"))
        assert f"{v.epoch} {v.version} {values} {human_size(v.size)}" in page, page[:3000]
        assert v.url in page
    assert f"{len(versions)} Items" in page


def test_training_curve_is_drawn_in_the_browser(browser, stack, trained, store):
    """The curve artifact shows as an image (an SVG in a data: URL), one panel per metric, and the
    table below it holds the store's metrics."""
    curve = run_artifact(trained.run_id, f"ckptflow-{slug(trained.name)}-curve")
    versions = store.versions()
    names = list(versions[0].metrics)
    browser.open(f"{stack.ui}/artifacts/artifact/{curve.id}")
    page = browser.wait_for_text("Training curve of store", f"Last {len(versions)} of {len(versions)} epochs")
    drawn = "(() => { const i = document.querySelector('img[alt=\"training curve\"]');"
    drawn += " return i && i.complete ? [i.naturalWidth, i.naturalHeight] : null; })()"
    size = None
    deadline = time.monotonic() + 30
    while size is None and time.monotonic() < deadline:
        size = browser.evaluate(drawn)
        time.sleep(0.25)
    browser.screenshot(OUTPUT / "deploy-training-curve.png")
    assert size == [WIDTH, PANEL * len(names)], (size, page[:2000])  # the SVG decoded and laid out
    assert "epoch " + " ".join(names) in page, page[:3000]
    for v in versions:
        values = " ".join(metric_value(v.metrics[n]) for n in names)
        assert f"{v.epoch} {values}" in page, page[:3000]


def test_latest_checkpoint_card_of_the_store(browser, stack, trained, store):
    card = run_artifact(trained.run_id, f"{store_key(store.url)}-latest")
    newest = store.latest()
    assert newest is not None
    browser.open(f"{stack.ui}/artifacts/artifact/{card.id}")
    page = browser.wait_for_text(f"Latest checkpoint of {store.url}", newest.url)
    browser.screenshot(OUTPUT / "deploy-latest-checkpoint.png")
    assert f"Latest checkpoint of {store.url}" in page, page[:3000]
    assert f"version {newest.version} (epoch {newest.epoch})" in page
    assert f"size {human_size(newest.size)}" in page
    assert f"`{newest.url}`" not in page, "the URL shows literal backticks"
    assert f"ckptflow restore {store.url} --out model.pt" in page
    assert_no_link_into(browser, trained.storage)
    assert_links_resolve(browser)
    assert clipped(browser) == []
    # the run's own card of its newest checkpoint, likewise
    own = run_artifact(trained.run_id, f"ckptflow-{slug(trained.name)}-latest")
    browser.open(f"{stack.ui}/artifacts/artifact/{own.id}")
    page = browser.wait_for_text(newest.url)
    assert f"v{newest.version} (epoch {newest.epoch}" in page, page[:3000]
    assert_no_link_into(browser, trained.storage)
    assert_links_resolve(browser)
    # ...and the run's summary
    summary = run_artifact(trained.run_id, f"ckptflow-{slug(trained.name)}-summary")
    browser.open(f"{stack.ui}/artifacts/artifact/{summary.id}")
    page = browser.wait_for_text("ckptflow run summary: Completed", "wall time")
    browser.screenshot(OUTPUT / "deploy-run-summary.png")
    assert "wall time" in page and "world size" in page, page[:3000]
    assert_links_resolve(browser)
    assert clipped(browser) == []


def clipped(browser) -> list[str]:
    """The texts on the page that the UI cuts off (an element narrower than its text, whose overflow
    is hidden: an ellipsis or nothing), each with its full width and the width shown."""
    script = """[...document.querySelectorAll('main *, .p-layout-default__content *')]
        .filter(e => e.children.length === 0 && e.innerText && e.innerText.trim()
                && e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible')
        .map(e => e.innerText.trim().slice(0, 120) + ' (' + e.scrollWidth + '>' + e.clientWidth + ' px)')"""
    return sorted(set(browser.evaluate(script) or []))


def assert_links_resolve(browser) -> None:
    """Every link in the artifact's own text opens: an http(s) URL that answers, nothing else."""
    import urllib.request

    hrefs = browser.evaluate("[...document.querySelectorAll('.markdown-renderer a[href]')].map(a => a.href)")
    for href in hrefs or []:
        assert href.startswith(("http://", "https://")), href
        with urllib.request.urlopen(href, timeout=30) as answer:
            assert answer.status == 200, href


def assert_no_link_into(browser, storage: Path) -> None:
    """Bug: a store's local path was a markdown link, which the UI resolved against its own address
    (http://<server>/<path>/v000003: "Page not found"). Paths are text to copy; no link leads there."""
    hrefs = browser.evaluate("[...document.querySelectorAll('a[href]')].map(a => a.href)")
    assert hrefs, "the page has no links at all: not the UI's page"
    assert [h for h in hrefs if str(storage) in h] == [], hrefs


def test_artifacts_page_has_one_entry_per_store(browser, stack, trained, store):
    browser.open(f"{stack.ui}/artifacts")
    key = store_key(store.url)
    page = browser.wait_for_text(f"{key}-checkpoints", f"{key}-latest")
    browser.screenshot(OUTPUT / "deploy-artifacts-page.png")
    assert f"{key}-checkpoints" in page and f"{key}-latest" in page, page[:3000]
