"""What a run shows in Prefect: its artifacts, events, curve, summaries, and its talk with the API.

The flow's process reports as it goes (:mod:`.monitoring`: the checkpoint table, the progress,
the committed events and the run's own record of its commits), finishes runs whose process died
(:mod:`.crashed`), reads a clean stop as one (:mod:`.clean_stop`) and says what a mirror lacks
(:mod:`.mirroring`). Every question to the Prefect API is :mod:`.prefect_runs`'s. Reporting never
breaks training: an API failure is logged and skipped. The training processes never import this.
"""
