"""Where metrics and samples go (`log` section): the samples table, its cadence and
rows, the trackers that are picked, W&B (offline) and MLflow (a file store)
receiving the config, the metrics and the tables and continuing on resume, and
the refusals: among them servers that cannot be used (real localhost sockets: a
closed port, and one that accepts but never answers), refused before any engine
and bounded by log.tracker_timeout_s, leaving the run folder as it was. All
in-process but one `train` command; the 2-rank `train` run of
tests/test_train_cli.py checks the same on real ranks."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybrid_engine.config import LogConfig, RunConfig, apply_overrides
from hybrid_engine.metrics import MetricsSink
from hybrid_engine.output_dir import OutputDir
from hybrid_engine.preflight import check_trackers
from hybrid_engine.testing import run_cli
from hybrid_engine.tracking import samples_table
from hybrid_engine.trajectory import Trajectory
from tests.test_preflight import _refusal

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


# --- servers that cannot be used ---------------------------------------------------


def _closed_port() -> int:
    """A localhost port nothing listens on (bound, read, closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _silent_server() -> Iterator[str]:
    """The URL of a localhost server that accepts connections (the kernel's
    backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _files(folder: Path) -> dict[str, bytes | None]:
    """Everything under folder: {relative path: a file's bytes, None for a folder}."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
            for p in sorted(folder.rglob("*"))}


def _earlier_run(folder: Path) -> dict[str, bytes | None]:
    """An earlier run's files in folder (a checkpoint, metrics); returns `_files`."""
    (folder / "checkpoints" / "step_2").mkdir(parents=True)
    (folder / "checkpoints" / "step_2" / "model.safetensors").write_bytes(b"w" * 16)
    (folder / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    return _files(folder)


@EXTRA
def test_an_mlflow_server_that_is_down_is_refused_before_any_engine(model_dir, tmp_path,
                                                                    monkeypatch) -> None:
    """Through the train command's preflight, in seconds (MLflow's own retries took
    about 5 minutes after the engine had started), with MLflow's offline mode named."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    t0 = time.monotonic()
    message = _refusal(model_dir, tmp_path / "run", "--log.trackers=jsonl,mlflow")
    assert time.monotonic() - t0 < 30, message
    assert "log.trackers has mlflow, but MLFLOW_TRACKING_URI=http://127.0.0.1:" in message
    assert "did not answer within log.tracker_timeout_s=30 s" in message
    assert message.endswith("unset MLFLOW_TRACKING_URI to log to the run's own file store "
                            "(<output_dir>/mlruns)") and "\n" not in message


@EXTRA
def test_tracker_timeout_s_bounds_a_server_that_never_answers(tmp_path, monkeypatch) -> None:
    """log.tracker_timeout_s=2: the preflight's request and the start itself end near
    it (MLflow's defaults: 8 tries of up to 120 s each); the failed start leaves an
    earlier run's folder as it was and MLflow's variables as they were."""
    before = _earlier_run(tmp_path)
    with _silent_server() as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=rf"MLFLOW_TRACKING_URI={url} did not answer within "
                                             r"log.tracker_timeout_s=2 s \(timed out\)"):
            check_trackers(("mlflow",), timeout_s=2)
        assert 1.5 < time.monotonic() - t0 < 12
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"log.trackers: mlflow did not start \("
                                             r"log.tracker_timeout_s=2 bounds .*; unset "
                                             r"MLFLOW_TRACKING_URI .*: MlflowException: .*timed"):
            MetricsSink(tmp_path, LogConfig(trackers=("jsonl", "mlflow"), tracker_timeout_s=2),
                        resume=3)
        assert time.monotonic() - t0 < 2 + 15
    assert _files(tmp_path) == before  # no trackers.json, metrics.jsonl untouched
    assert not {"MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"} & set(os.environ)


@EXTRA
def test_wandb_online_needs_a_login_and_its_server(tmp_path, monkeypatch) -> None:
    """WANDB_MODE unset: without WANDB_API_KEY or a ~/.netrc entry for its host,
    and with one but the server down, preflight refuses naming WANDB_MODE=offline;
    offline needs neither."""
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    host = f"127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("WANDB_BASE_URL", f"http://{host}")
    with pytest.raises(ValueError, match=r"log.trackers has wandb, but no W&B login was found "
                                         r"for http://127.0.0.1:\d+ \(WANDB_API_KEY, .*\): log "
                                         r"in, or set WANDB_MODE=offline to log without"):
        check_trackers(("jsonl", "wandb"))
    (tmp_path / ".netrc").write_text(f"machine {host}\n  login user\n  password {'a' * 40}\n")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"W&B's server http://{host} did not answer within "
                                         r"log.tracker_timeout_s=30 s \(.*refused\): start it, "
                                         r"or set WANDB_MODE=offline"):
        check_trackers(("jsonl", "wandb"))
    assert time.monotonic() - t0 < 10
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_trackers(("jsonl", "wandb"))


@EXTRA
def test_a_wandb_start_is_bounded_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    """A W&B server that never answers, past the preflight: wandb.init gives up at
    log.tracker_timeout_s=3 (W&B's own init_timeout is 90 s) and the run folder
    keeps no wandb/ of the run that did not start."""
    import wandb

    wandb.teardown()  # wandb reads its environment once a process: an earlier test's offline
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    out = tmp_path / "run"
    out.mkdir()
    before = _earlier_run(out)
    with _silent_server() as url:
        monkeypatch.setenv("WANDB_BASE_URL", url)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"log.trackers: wandb did not start \(log."
                                             r"tracker_timeout_s=3 bounds .*; set WANDB_MODE="
                                             r"offline .*\): CommError: "):
            MetricsSink(out, LogConfig(trackers=("jsonl", "wandb"), tracker_timeout_s=3),
                        resume=3)
        assert time.monotonic() - t0 < 60
    assert _files(out) == before
    wandb.teardown()  # nor this test's online one for the next


def test_a_job_that_does_not_start_leaves_the_folder_as_it_found_it(tmp_path) -> None:
    """`OutputDir.unlock(remove_if_unused=True)`: the lock file it made goes, and
    the folders it made when empty; an earlier run's files and lock stay."""
    OutputDir(tmp_path / "new" / "run").unlock(remove_if_unused=True)
    assert list(tmp_path.iterdir()) == []
    before = _earlier_run(tmp_path / "old")
    folder = OutputDir(tmp_path / "old")
    assert (tmp_path / "old" / ".lock").is_file()
    folder.unlock(remove_if_unused=True)
    assert _files(tmp_path / "old") == before
    OutputDir(tmp_path / "old").unlock()  # a job that ran: its lock file stays
    OutputDir(tmp_path / "old").unlock(remove_if_unused=True)
    assert (tmp_path / "old" / ".lock").is_file()


@EXTRA
def test_train_with_an_mlflow_server_that_is_down(model_dir, tmp_path) -> None:
    """`hybrid-engine train` (1 rank): one error line, no traceback, no folder made."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_cli(["train", "--recipe=tiny_grpo_debug", "--no-progress",
                    f"--model.path={model_dir}", f"--output_dir={out}",
                    "--log.trackers=jsonl,mlflow"], timeout=120,
                   env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{_closed_port()}"})
    took = time.monotonic() - t0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "unset MLFLOW_TRACKING_URI" in errors[0] and "Traceback" not in proc.stderr
    assert not out.exists()
    print(f"error line after {took:.1f} s")
