"""Where metrics and samples go (`log` section): the samples table, its cadence and
rows, the trackers that are picked, W&B (offline) and MLflow (a file store)
receiving the config, the metrics and the tables and continuing on resume, and
the refusals. All in-process; the 2-rank `train` run of tests/test_train_cli.py
checks the same on real ranks."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import struct
from pathlib import Path

import pytest

from hybrid_engine.config import LogConfig, RunConfig, apply_overrides
from hybrid_engine.metrics import MetricsSink
from hybrid_engine.tracking import samples_table
from hybrid_engine.trajectory import Trajectory

EXTRA = pytest.mark.skipif(
    not (importlib.util.find_spec("wandb") and importlib.util.find_spec("mlflow")),
    reason="the trackers extra is not installed (pip install 'hybrid_engine[trackers]')")


def _decode(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def _trajs(n: int = 4) -> list[Trajectory]:
    out = []
    for i in range(n):
        t = Trajectory(prompt_ids=[1, 2], response_ids=[3, 4, 5 + i], rollout_logp=[0.0] * 3,
                       reward=float(i), group_id=i // 2, policy_version=7,
                       reward_components={"correct": float(i % 2)} | ({"format": 0.5} if i else {}),
                       loss_mask=[True, False, True], advantages=[1.0, 9.0, 2.0 * i])
        out.append(t)
    return out


def test_the_samples_table_has_every_column() -> None:
    columns, rows = samples_table(3, _trajs(), _decode, rows=3)
    assert columns == ["step", "group", "prompt", "completion", "reward", "reward/correct",
                       "reward/format", "advantage", "length", "policy_version"]
    # advantage: the mean over the sampled tokens (the env token's 9.0 left out).
    assert rows == [[3, 0, "t1 t2", "t3 t4 t5", 0.0, 0.0, None, 0.5, 2, 7],
                    [3, 0, "t1 t2", "t3 t4 t6", 1.0, 1.0, 0.5, 1.5, 2, 7],
                    [3, 1, "t1 t2", "t3 t4 t7", 2.0, 0.0, 0.5, 2.5, 2, 7]]


def _tb_texts(folder: Path) -> dict[int, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode()
            for e in acc.Tensors("samples_table/text_summary")}


def test_samples_every_and_rows_per_table(tmp_path) -> None:
    """log.samples_every picks the steps, log.samples_per_table the rows, in
    samples.jsonl and TensorBoard; a resume keeps the tables before its step."""
    sink = MetricsSink(tmp_path, LogConfig(samples_every=2, samples_per_table=3))
    for step in range(1, 6):
        sink.write_samples(step, _trajs(), _decode)
    sink.close()
    rows = [json.loads(ln) for ln in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 2, 2, 4, 4, 4]
    assert rows[1]["completion"] == "t3 t4 t6" and rows[1]["reward/format"] == 0.5
    texts = _tb_texts(tmp_path / "tb")
    assert sorted(texts) == [2, 4] and texts[4].count("t1 t2") == 3
    sink = MetricsSink(tmp_path, LogConfig(samples_every=0), resume=3)
    sink.write_samples(4, _trajs(), _decode)  # 0 = never
    sink.close()
    assert [json.loads(ln)["step"] for ln in
            (tmp_path / "samples.jsonl").read_text().splitlines()] == [2, 2, 2]


@pytest.mark.parametrize("trackers", [("jsonl",), ("tensorboard",)])
def test_trackers_pick_the_run_folders_outputs(tmp_path, trackers) -> None:
    sink = MetricsSink(tmp_path, LogConfig(trackers=trackers, samples_every=1))
    sink.write(1, {"reward_mean": 0.5})
    sink.write_samples(1, _trajs(), _decode)
    sink.close()
    assert (tmp_path / "metrics.jsonl").exists() == ("jsonl" in trackers)
    assert (tmp_path / "samples.jsonl").exists() == ("jsonl" in trackers)
    assert (tmp_path / "tb").exists() == ("tensorboard" in trackers)


def test_log_every_spaces_the_step_line(tmp_path, caplog) -> None:
    """log.every: the step line every n steps, and on every evaluation."""
    sink = MetricsSink(tmp_path, LogConfig(every=2))
    with caplog.at_level(logging.INFO, logger="hybrid_engine.train"):
        for step in range(1, 6):
            sink.write(step, {"reward_mean": 0.1} | ({"eval/accuracy": 1.0} if step == 3 else {}))
    sink.close()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["step 2", "step 3", "step 4"]


@pytest.mark.parametrize(("value", "message"), [
    ("jsonl,comet", "log.trackers has 'comet': each must be one of jsonl, tensorboard, wandb, "
                    "mlflow"),
    ("jsonl,jsonl", "log.trackers=jsonl,jsonl names a tracker twice")])
def test_bad_trackers_are_refused(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        apply_overrides(RunConfig(), [f"log.trackers={value}"])


def test_a_tracker_that_is_not_installed_is_refused(monkeypatch) -> None:
    from hybrid_engine import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    preflight.check_trackers(("jsonl", "mlflow") if real("mlflow") else ("jsonl",))
    with pytest.raises(ValueError, match=r"log.trackers has wandb, which is not installed: pip "
                                         r"install 'hybrid_engine\[trackers\]'"):
        preflight.check_trackers(("jsonl", "wandb"))


# --- W&B and MLflow --------------------------------------------------------------


def wandb_records(out: Path) -> list:
    """The records of the W&B run under out (an offline run's .wandb file: a
    LevelDB-style log of protobuf records after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, buf, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if not size and not kind:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + size], pos + 7 + size
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
            buf = b""
    return records


def wandb_history(out: Path) -> tuple[dict, dict[int, dict], str]:
    """(config, {step: logged values}, run name) of the W&B run under out."""
    config, history, name = {}, {}, ""
    for r in wandb_records(out):
        kind = r.WhichOneof("record_type")
        if kind == "config":
            config |= {i.key: json.loads(i.value_json) for i in r.config.update}
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in r.history.item}
            history[row["_step"]] = row
        elif kind == "run":
            name = r.run.display_name
    return config, history, name


def wandb_table(out: Path, step: int) -> dict:
    """The samples table logged at step ({"columns", "data"}), found through the
    step's history row (W&B names the file by its own counter)."""
    (run,) = (out / "wandb").glob("offline-run-*")
    path = wandb_history(out)[1][step]["samples_table/path"]
    return json.loads((run / "files" / path).read_text())


def mlflow_run(out: Path) -> tuple:
    """(client, run) of the one MLflow run in out/mlruns."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens them on request
    uri = (out / "mlruns").resolve().as_uri()
    client = MlflowClient(uri, registry_uri=uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "hybrid-engine"]
    (run,) = client.search_runs([exp.experiment_id])
    return client, run


def mlflow_samples(run) -> list[dict]:  # noqa: ANN001
    """The rows of the run's samples.json artifact (pandas' split layout)."""
    from urllib.parse import urlparse

    table = json.loads((Path(urlparse(run.info.artifact_uri).path) / "samples.json").read_text())
    return [dict(zip(table["columns"], row)) for row in table["data"]]


@EXTRA
def test_wandb_and_mlflow_receive_config_metrics_and_samples(tmp_path, monkeypatch,
                                                             caplog) -> None:
    """Offline, no network: the resolved config, every step's metrics (MLflow's
    names without '@') and the samples tables; a resumed sink continues both runs."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # empty = unset (and restored after)
    log = LogConfig(trackers=("wandb", "mlflow"), samples_every=2, samples_per_table=2)
    sink = MetricsSink(tmp_path, log, run_name="run-a", config={"train.lr": 1e-6, "seed": 3})
    for step in (1, 2):
        sink.write(step, {"reward_mean": step / 10, "eval/pass@4": 0.25 * step})
        sink.write_samples(step, _trajs(), _decode)
    sink.close()
    assert not (tmp_path / "metrics.jsonl").exists()  # jsonl was not asked for
    config, history, name = wandb_history(tmp_path)
    assert name == "run-a" and config["train.lr"] == 1e-6 and config["seed"] == 3
    assert history[1]["reward_mean"] == 0.1 and history[2]["eval/pass@4"] == 0.5
    table = wandb_table(tmp_path, 2)
    assert table["columns"][:4] == ["step", "group", "prompt", "completion"]
    assert [row[3] for row in table["data"]] == ["t3 t4 t5", "t3 t4 t6"]
    client, run = mlflow_run(tmp_path)
    assert run.info.run_name == "run-a" and run.data.params["train.lr"] == "1e-06"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/pass_at_4")] \
        == [0.25, 0.5]
    assert [r["completion"] for r in mlflow_samples(run)] == ["t3 t4 t5", "t3 t4 t6"]
    # Resumed: the same MLflow run (and W&B run id) goes on.
    # ... with a changed config: W&B takes it, MLflow keeps its first values and says so.
    with caplog.at_level(logging.WARNING, logger="hybrid_engine.tracking"):
        sink = MetricsSink(tmp_path, log, resume=3, run_name="run-a",
                           config={"train.lr": 2e-6, "seed": 3, "train.num_steps": 9})
    sink.write(3, {"reward_mean": 0.3})
    sink.close()
    assert "changed on resume: train.lr (1e-06 -> 2e-06)" in caplog.text
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1  # one id
    client, run2 = mlflow_run(tmp_path)
    assert run2.info.run_id == run.info.run_id
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1, 2, 3]
    assert run2.data.params["train.lr"] == "1e-06" and run2.data.params["train.num_steps"] == "9"
    # The store was this run's: nothing of it stays in the environment (child processes,
    # a next run in this process).
    assert os.environ["MLFLOW_TRACKING_URI"] == ""
