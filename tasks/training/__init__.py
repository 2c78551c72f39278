"""The training processes: the code that runs where the model lives, and never imports Prefect.

The flow drives training through one protocol (:mod:`.protocol`) with two implementations: the
trainers in processes of their own (:mod:`.trainer`, the flow's side; :mod:`.launcher`, torch's
elastic launcher in a child; :mod:`.rank_worker`, each rank) and the one rank in the flow's own
process (:mod:`.in_process`). Both serve the same :class:`.rank.Rank`, which builds the spec,
restores the newest version (:mod:`.run_state`, :mod:`.training_state`), trains and saves.

What must hold: nothing here imports Prefect (a layering test reads every import, and a test
looks at a ``--nproc 2`` run's ranks). What the training processes need of the run comes from
the shared config (:mod:`..config`) and the spec contract (:mod:`..spec`); what the flow shows in
Prefect is :mod:`..reporting`'s.
"""
