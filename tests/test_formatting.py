"""The one way ckptflow writes a moment (tasks/reporting/formatting.py's utc_text)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from ckptflow.tasks.reporting.formatting import utc_text


def test_a_moment_is_written_in_utc_whatever_zone_it_came_in() -> None:
    berlin = timezone(timedelta(hours=1))
    moment = datetime(2026, 11, 25, 13, 1, 2, 345000, tzinfo=berlin)
    assert utc_text(moment) == "2026-11-25 12:01:02 UTC"
    assert utc_text(moment.isoformat()) == "2026-11-25 12:01:02 UTC"  # a manifest's `created`
    assert utc_text(moment, seconds=False) == "2026-11-25 12:01 UTC"
    assert utc_text(moment, seconds=False, zone=False) == "2026-11-25 12:01"


def test_a_naive_moment_is_taken_as_utc_and_text_that_is_no_time_is_kept() -> None:
    assert utc_text(datetime(2026, 1, 2, 3, 4, 5)) == "2026-01-02 03:04:05 UTC"
    assert utc_text("yesterday") == "yesterday"
    assert utc_text(None) == "at an unknown time"
