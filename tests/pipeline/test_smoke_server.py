from ckptflow.flows.train import train_pipeline
from ckptflow.tasks.config import PipelineConfig


def test_flow_runs_against_server(prefect_server, tmp_path):
    out = train_pipeline(PipelineConfig(storage=str(tmp_path / "s"), epochs=2))
    assert out["last_epoch"] == 2
