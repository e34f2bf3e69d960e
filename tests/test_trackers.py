"""watch(log_to=...) streaming to the trackers users already watch (graddbg/trackers.py): the
real TensorBoard, wandb (offline) and MLflow (a SQLite store) read back after the run, a
callable, and the Lightning callback's metrics reaching a Lightning logger; every value is
compared with what the watch recorded in the same run (``w.steps``, ``w.stats``)."""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import graddbg

STEPS, NAN_AT = 4, 3  # (the NaN at the last step: the NaN weights it makes would be findings after it)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.enc(x))


def train(log_to=None, nan_at=-1, steps=STEPS, **options):
    """A small loop (a NaN loss at ``nan_at``, recorded, not raised); returns the watch."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graddbg.watch(model, opt, log_to=log_to, nonfinite="record", localise=False, update_every=2,
                       **options) as w:
        for i in range(steps):
            loss = model(torch.randn(16, 4)).pow(2).mean() * (math.nan if i == nan_at else 1.0)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return w


def recorded(w, column):
    """``{step: value}`` of a column of w.steps."""
    return dict(zip(w.steps["step"].tolist(), w.steps[column].tolist()))


def module_norms(w):
    """The norm of each top-level module per step, from w.stats (torch's rule: root of the sum of squares)."""
    s = w.stats.assign(top=lambda f: f["name"].astype(str).str.split(".").str[0])
    return s.groupby(["step", "top"])["norm"].apply(lambda v: math.sqrt((v ** 2).sum())).to_dict()


# --------------------------------------------------------------------------- a callable
def test_a_callable_gets_the_recorded_values_of_each_step():
    calls = []
    w = train(lambda metrics, step: calls.append((step, metrics)))
    steps = [(s, m) for s, m in calls if "graddbg/global_norm" in m]
    assert [s for s, _ in steps] == list(range(STEPS))
    norms = module_norms(w)
    for s, m in steps:
        assert m["graddbg/global_norm"] == pytest.approx(recorded(w, "global_norm")[s], rel=1e-12)
        assert m["graddbg/loss"] == pytest.approx(recorded(w, "loss")[s], rel=1e-12)
        assert m["graddbg/lr"] == 0.05
        assert m["graddbg/anomalies"] == 0.0
        assert m["graddbg/norm/enc"] == pytest.approx(norms[(s, "enc")], rel=1e-9)
        assert m["graddbg/norm/head"] == pytest.approx(norms[(s, "head")], rel=1e-9)


def test_update_ratios_are_logged_at_the_step_they_were_measured_after():
    calls = []
    w = train(lambda metrics, step: calls.append((step, metrics)))
    ratios = {s: m for s, m in calls if any(k.startswith("graddbg/update_ratio/") for k in m)}
    assert sorted(ratios) == [0, 2]  # (update_every=2)
    stats = w.stats.assign(top=lambda f: f["name"].astype(str).str.split(".").str[0])
    largest = stats.groupby(["step", "top"])["update_ratio"].max()
    for s, m in ratios.items():
        assert m["graddbg/update_ratio/enc"] == pytest.approx(largest[(s, "enc")], rel=1e-12)
        assert m["graddbg/update_ratio/head"] == pytest.approx(largest[(s, "head")], rel=1e-12)


def test_log_detail_param_logs_each_parameter():
    calls = []
    w = train(lambda metrics, step: calls.append((step, metrics)), log_detail="param")
    last = [m for s, m in calls if s == STEPS - 1 and "graddbg/global_norm" in m][0]
    norms = w.stats[w.stats["step"] == STEPS - 1].set_index("name")["norm"]
    assert {k for k in last if k.startswith("graddbg/norm/")} == {f"graddbg/norm/{n}" for n in norms.index}
    for name, norm in norms.items():
        assert last[f"graddbg/norm/{name}"] == pytest.approx(norm, rel=1e-12)


def test_each_finding_is_a_text_event_and_counted():
    calls = []
    w = train(lambda metrics, step: calls.append((step, metrics)), nan_at=NAN_AT)
    texts = [(s, m["graddbg/finding"]) for s, m in calls if "graddbg/finding" in m]
    assert texts == [(NAN_AT, f"[nonfinite] {w.anomalies[0].message}")]
    counts = {s: m["graddbg/anomalies"] for s, m in calls if "graddbg/anomalies" in m}
    assert counts == {0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0}
    at_nan = [m for s, m in calls if s == NAN_AT and "graddbg/global_norm" in m][0]
    assert math.isnan(at_nan["graddbg/global_norm"])  # (the NaN itself is logged)
    assert "graddbg/loss" not in at_nan  # (a NaN loss is not told from an unknown one)


def test_log_to_adds_no_host_synchronisation():
    without = train()
    with_ = train(lambda metrics, step: None, log_detail="param")
    assert with_.host_syncs == without.host_syncs == STEPS


# --------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("value, error, message", [
    ("tensorboard", ValueError, r"watch\(log_to=\.\.\.\): got 'tensorboard'; accepted: None, a torch.utils"),
    (3, TypeError, r"watch\(log_to=\.\.\.\): got 3 \(int\); accepted: None, a torch.utils.tensorboard"),
    ([print, "neptune"], ValueError, r"got 'neptune'; accepted"),
    (pytest.param("SummaryWriter class", TypeError, r"got <class .*SummaryWriter'> \(type\); accepted",
                  id="a class, not an instance")),
])
def test_a_bad_log_to_names_the_argument_what_was_given_and_what_is_accepted(value, error, message):
    if value == "SummaryWriter class":
        from torch.utils.tensorboard import SummaryWriter as value
    with pytest.raises(error, match=message):
        graddbg.watch(nn.Linear(2, 1), log_to=value)


def test_a_bad_log_detail_is_an_error():
    with pytest.raises(ValueError, match=r"watch\(log_detail=\.\.\.\): got 'layer'; accepted: 'module'"):
        graddbg.watch(nn.Linear(2, 1), log_to=print, log_detail="layer")


def test_the_callbacks_check_log_to_when_built():
    import graddbg.callbacks as gcb

    with pytest.raises(TypeError, match=r"LightningCallback\(log_to=\.\.\.\): got 3"):
        gcb.LightningCallback(log_to=3)


def test_wandb_without_an_active_run_is_an_error_at_watch_time():
    wandb = pytest.importorskip("wandb")
    assert wandb.run is None
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"log_to='wandb'\): no wandb run is active; call wandb.init"):
        graddbg.watch(model, log_to="wandb")
    assert not model._forward_hooks  # (nothing left attached)


def test_mlflow_without_an_active_run_is_an_error_at_watch_time():
    mlflow = pytest.importorskip("mlflow")
    assert mlflow.active_run() is None
    with pytest.raises(ValueError, match=r"log_to='mlflow'\): no MLflow run is active; call mlflow.start_run"):
        graddbg.watch(nn.Linear(2, 1), log_to="mlflow")


# --------------------------------------------------------------------------- TensorBoard
def test_tensorboard_scalars_and_findings_read_back_from_the_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        w = train(writer, nan_at=NAN_AT)
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    for column in ("global_norm", "loss", "lr"):
        got = {e.step: e.value for e in ea.Scalars(f"graddbg/{column}")}
        want = {s: v for s, v in recorded(w, column).items() if not (column == "loss" and math.isnan(v))}
        assert sorted(got) == sorted(want), column
        for s, v in want.items():
            assert got[s] == pytest.approx(v, rel=1e-6, nan_ok=True), (column, s)
    texts = ea.Tensors("graddbg/finding/text_summary")
    assert [e.step for e in texts] == [NAN_AT]
    assert w.anomalies[0].message in texts[0].tensor_proto.string_val[0].decode()


# --------------------------------------------------------------------------- wandb
def wandb_history(path: pathlib.Path) -> list:
    """The history rows of an offline run's transaction log (``run-<id>.wandb``): wandb's
    LevelDB-style log (a 7-byte header, then records in 32 KiB blocks, each chunk with a
    7-byte header: checksum, length, type), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, records, part, pos, block = path.read_bytes(), [], b"", 7, 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4: pos + 6], "little"), data[pos + 6]
        if left < 7 or (kind == 0 and length == 0):  # (the zero padding at a block's end)
            pos += left
            continue
        part += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            records.append(part)
            part = b""
    rows = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.parametrize("given", ["the run", "'wandb'"])
def test_wandb_offline_history_holds_the_recorded_values(tmp_path, monkeypatch, given):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="graddbg-test", settings=wandb.Settings(console="off"))
    try:
        log = run.sync_file if hasattr(run, "sync_file") else run.settings.sync_file
        files = pathlib.Path(run.dir)
        w = train(run if given == "the run" else "wandb", nan_at=NAN_AT)
    finally:
        run.finish()
        wandb.teardown()
    rows = wandb_history(pathlib.Path(log))
    steps = {r["graddbg/step"]: r for r in rows if "graddbg/global_norm" in r}
    assert sorted(steps) == list(range(STEPS))
    for s, row in steps.items():
        assert row["graddbg/global_norm"] == pytest.approx(recorded(w, "global_norm")[s], rel=1e-12, nan_ok=True)
        assert row["graddbg/lr"] == 0.05
        if s != NAN_AT:
            assert row["graddbg/loss"] == pytest.approx(recorded(w, "loss")[s], rel=1e-12)
    findings = [r for r in rows if "graddbg/finding" in r]
    assert [r["graddbg/step"] for r in findings] == [NAN_AT]
    assert w.anomalies[0].message in findings[0]["graddbg/finding"]
    # the table of the findings: logged with the finding, its file among the run's media
    table = {k[len("graddbg/findings/"):]: v for k, v in findings[0].items() if k.startswith("graddbg/findings/")}
    assert table["_type"] == "table-file" and table["nrows"] == 1 and table["ncols"] == 2, table
    data = json.loads((files / table["path"]).read_text())
    assert data["columns"] == ["step", "finding"] and data["data"][0][0] == NAN_AT
    assert w.anomalies[0].message in data["data"][0][1] and len(data["data"]) == 1


# --------------------------------------------------------------------------- MLflow
def test_mlflow_metric_history_and_finding_tags(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # (MLflow's default artifact folder, ./mlruns, stays in tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    with mlflow.start_run() as run:
        w = train("mlflow", nan_at=NAN_AT)
    client = MlflowClient()
    for column in ("global_norm", "loss", "lr"):
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"graddbg/{column}")}
        want = {s: v for s, v in recorded(w, column).items() if not (column == "loss" and math.isnan(v))}
        assert sorted(got) == sorted(want), column
        for s, v in want.items():
            assert got[s] == pytest.approx(v, rel=1e-12, nan_ok=True), (column, s)
    tags = client.get_run(run.info.run_id).data.tags
    assert tags["graddbg/finding/1"].startswith(f"step {NAN_AT}: [nonfinite] ")
    assert w.anomalies[0].message[:200] in tags["graddbg/finding/1"]


# --------------------------------------------------------------------------- Lightning
def test_the_lightning_callback_sends_the_same_metrics_to_the_trainers_logger(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    import graddbg.callbacks as gcb

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.losses = Net(), []

        def training_step(self, batch, batch_idx):
            loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    cb, module = gcb.LightningCallback(), Module()
    trainer = L.Trainer(callbacks=[cb], accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        logger=L.loggers.CSVLogger(tmp_path), log_every_n_steps=1, default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    logged = pd.read_csv(f"{trainer.log_dir}/metrics.csv").dropna(subset=["graddbg/loss"])
    means = np.asarray(module.losses).reshape(-1, 2).mean(axis=1)  # (Lightning hands loss / 2 to backward)
    assert logged["graddbg/loss"].tolist() == pytest.approx(means.tolist(), rel=1e-6)
    assert logged["graddbg/loss"].tolist() == pytest.approx(cb.watch.steps["loss"].tolist(), rel=1e-6)
    assert logged["graddbg/global_norm"].tolist() == pytest.approx(cb.watch.steps["global_norm"].tolist(), rel=1e-6)
    assert logged["graddbg/lr"].tolist() == pytest.approx([0.05] * 4)  # (Lightning logs float32)
    assert {"graddbg/norm/net", "graddbg/anomalies"} <= set(logged.columns)
