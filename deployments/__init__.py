"""The deployment files (prefect.yaml, serve.py), installed as ckptflow.deployments for
`ckptflow deployments init`; run serve.py as a script, not as this package's module."""
