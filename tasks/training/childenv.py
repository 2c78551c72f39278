"""Environment variables the flow's process sets for the processes it starts (the trainers).

Its own module so that both sides can import the names: the flow's side without
torch, the children's side without Prefect.
"""

FLOW_RUN_ENV = "CKPTFLOW_FLOW_RUN_ID"  # the flow run, for the spec's own logging
TRAINER_FD_ENV = "CKPTFLOW_TRAINER_FD"  # the launcher's end of the flow's channel (its leader rank's)
