"""graddbg.callbacks driving a real lightning.pytorch.Trainer and a real transformers.Trainer
on tiny models (CPU, a few steps), every recorded norm compared with what torch itself
reports inside the same run: Lightning's ``on_before_optimizer_step`` (before clipping) and
``configure_gradient_clipping`` (after), transformers' gradients after each backward and its
``on_pre_optimizer_step`` (after clipping). Accumulation 2 and clipping are on throughout.
"""
from __future__ import annotations

import json
import subprocess
import sys

import lightning.pytorch as L
import pandas as pd
import pytest
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import graddbg
import graddbg.callbacks as gcb

REL = 1e-5
BATCHES, ACCUMULATE = 8, 2
OPT_STEPS = BATCHES // ACCUMULATE

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*(GPU available|TPU available|LOCAL_RANK|log_every_n_steps).*"),
]


def global_norm(params) -> float:
    """torch's own global gradient norm, as clip_grad_norm_ computes it."""
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])))


def hook_census(model: nn.Module) -> list:
    """Every hook a module tree and its parameters carry."""
    out = []
    for m in model.modules():
        out.append((len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)))
    out += [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()]
    return out


# --------------------------------------------------------------------------- Lightning
class TinyModule(L.LightningModule):
    """A small regression net that records torch's global norm before and after clipping."""

    def __init__(self, fail_at: int = -1, nan_at: int = -1, via_forward: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.pre, self.post = [], []
        self.fail_at, self.nan_at, self.via_forward = fail_at, nan_at, via_forward

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("the user's training_step failed")
        x, y = batch
        if batch_idx == self.nan_at:
            x = x * float("nan")
        return nn.functional.mse_loss(self(x) if self.via_forward else self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.pre.append(global_norm(self.parameters()))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)
        self.post.append(global_norm(self.parameters()))


def regression_data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * BATCHES, 8, generator=g)
    y = 10 * x[:, :1] + torch.randn(4 * BATCHES, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def lightning_fit(root, cb, module=None, ckpt_path=None, **trainer_kwargs):
    torch.manual_seed(0)
    module = module or TinyModule()
    kwargs = dict(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=ACCUMULATE,
                  gradient_clip_val=0.5, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, logger=L.loggers.CSVLogger(root), log_every_n_steps=1,
                  default_root_dir=root)
    kwargs.update(trainer_kwargs)
    trainer = L.Trainer(callbacks=[cb], **kwargs)
    trainer.fit(module, regression_data(), ckpt_path=ckpt_path)
    return trainer, module


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    cb = gcb.LightningCallback(report=True)
    trainer, module = lightning_fit(root, cb)
    return trainer, module, cb


def test_lightning_global_norm_equals_torch_before_clipping(lightning_run):
    trainer, module, cb = lightning_run
    assert len(module.pre) == OPT_STEPS
    assert cb.watch.steps["global_norm"].tolist() == pytest.approx(module.pre, rel=REL)


def test_lightning_without_accumulation_global_norm_equals_torch(tmp_path):
    cb = gcb.LightningCallback()
    trainer, module = lightning_fit(tmp_path, cb, accumulate_grad_batches=1)
    assert len(module.pre) == BATCHES and all(post < pre for pre, post in zip(module.pre, module.post))
    assert cb.watch.steps["global_norm"].tolist() == pytest.approx(module.pre, rel=REL)
    assert cb.watch.steps["clipped_norm"].tolist() == pytest.approx(module.post, rel=REL)


def test_lightning_training_step_that_skips_forward_records_the_pre_clip_norm(tmp_path):
    """Many LightningModules call ``self.net(x)`` in training_step, never ``self(x)``."""
    cb = gcb.LightningCallback()
    trainer, module = lightning_fit(tmp_path, cb, module=TinyModule(via_forward=False), accumulate_grad_batches=1)
    assert cb.watch.steps["global_norm"].tolist() == pytest.approx(module.pre, rel=REL)


def test_lightning_clipped_norm_equals_torch_after_clipping(lightning_run):
    trainer, module, cb = lightning_run
    assert all(post < pre for pre, post in zip(module.pre, module.post))  # the clip did clip
    assert cb.watch.steps["clipped_norm"].tolist() == pytest.approx(module.post, rel=REL)


def test_lightning_one_record_per_optimizer_step(lightning_run):
    trainer, module, cb = lightning_run
    assert trainer.global_step == OPT_STEPS
    assert len(cb.watch.steps) == OPT_STEPS
    assert cb.watch.stats["step"].nunique() == OPT_STEPS


def test_lightning_names_are_the_modules_own(lightning_run):
    trainer, module, cb = lightning_run
    assert list(cb.watch.stats["name"].unique()) == [n for n, _ in module.named_parameters()]


def test_lightning_logs_norm_and_anomaly_count(lightning_run):
    trainer, module, cb = lightning_run
    metrics = pd.read_csv(f"{trainer.log_dir}/metrics.csv")
    logged = metrics.dropna(subset=[gcb.NORM_KEY])
    recorded = cb.watch.steps["global_norm"].tolist()
    assert logged[gcb.NORM_KEY].tolist() == pytest.approx(recorded, rel=REL)
    assert logged[gcb.ANOMALIES_KEY].tolist() == [0.0] * OPT_STEPS
    assert logged["step"].tolist() == list(range(OPT_STEPS))
    assert trainer.callback_metrics[gcb.NORM_KEY].item() == pytest.approx(recorded[-1], rel=REL)


def test_lightning_report_written_to_the_log_dir(lightning_run):
    trainer, module, cb = lightning_run
    path = cb.report_path()
    assert str(path.parent) == trainer.log_dir and path.name == "report.html"
    assert "<html" in path.read_text()[:2000].lower()


def test_lightning_watch_closed_and_model_clean_after_fit(lightning_run):
    trainer, module, cb = lightning_run
    assert "closed" in repr(cb.watch)
    assert hook_census(module) == hook_census(TinyModule())


def test_lightning_amp_scaler_is_picked_up(tmp_path):
    """Lightning's 16-mixed precision plugin (its GradScaler on the CPU): statistics of the
    unscaled gradients, equal to torch's after Lightning's unscale_, the scale recorded."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    cb = gcb.LightningCallback()
    trainer, module = lightning_fit(tmp_path, cb, plugins=[plugin])
    steps = cb.watch.steps
    finite = ~steps["overflow"].astype(bool)
    assert finite.sum() >= 2
    assert steps["scale"].notna().all()
    assert steps.loc[finite, "global_norm"].tolist() == pytest.approx(
        [n for n, ok in zip(module.pre, finite) if ok], rel=1e-3)


def test_lightning_training_that_raises_closes_the_watch_and_keeps_the_record(tmp_path):
    cb = gcb.LightningCallback(report=True)
    module = TinyModule(fail_at=5)
    with pytest.raises(RuntimeError, match="training_step failed"):
        lightning_fit(tmp_path, cb, module=module)
    assert "closed" in repr(cb.watch)
    assert hook_census(module) == hook_census(TinyModule())
    assert len(cb.watch.steps) == 2 and cb.report_path().exists()


@pytest.mark.parametrize("nan_at", [2, 3],
                         ids=["first-micro-batch", "micro-batch-in-the-closure"])
def test_lightning_nonfinite_raise_stops_fit_with_the_anomaly(tmp_path, nan_at):
    cb = gcb.LightningCallback(localize=False)
    with pytest.raises(graddbg.NonFiniteError) as info:
        lightning_fit(tmp_path, cb, module=TinyModule(nan_at=nan_at))
    assert info.value.anomaly.step == 1  # batches 2 and 3 make optimizer step 1
    assert [a.kind for a in cb.watch.anomalies] == ["nonfinite"]
    assert "closed" in repr(cb.watch)


def test_lightning_callback_also_runs_in_a_pytorch_lightning_trainer(tmp_path):
    """Lightning calls callbacks by hook name: the class works in either package's Trainer."""
    import pytorch_lightning as pl

    cb = gcb.LightningCallback()

    class PLModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.pre = []

        forward = TinyModule.forward
        configure_optimizers = TinyModule.configure_optimizers
        on_before_optimizer_step = TinyModule.on_before_optimizer_step

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self(batch[0]), batch[1])

    torch.manual_seed(0)
    module = PLModule()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         logger=False, default_root_dir=tmp_path, callbacks=[cb])
    trainer.fit(module, regression_data())
    assert cb.watch.steps["global_norm"].tolist() == pytest.approx(module.pre, rel=REL)


# --------------------------------------------------------------------------- transformers
class TokenData(Dataset):
    def __init__(self, n: int, length: int = 12, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class RecordingTrainer(transformers.Trainer):
    """Records torch's global norm after every backward pass (the last one before an
    optimizer step is the accumulated, pre-clip gradient)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.after_backward = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.after_backward.append(global_norm(model.parameters()))
        return loss


class PreStepNorms(transformers.TrainerCallback):
    """torch's global norm in on_pre_optimizer_step (transformers clips before it)."""

    def __init__(self) -> None:
        self.norms = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms.append(global_norm(model.parameters()))


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def transformers_train(out, cb, model=None, scaler=None, **args_kwargs):
    model = model or tiny_gpt2()
    kwargs = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=ACCUMULATE,
                  max_grad_norm=0.05, max_steps=OPT_STEPS, logging_steps=1, report_to=[], use_cpu=True,
                  save_strategy="no", disable_tqdm=True, learning_rate=1e-3, lr_scheduler_type="constant",
                  dataloader_num_workers=0, seed=0)
    kwargs.update(args_kwargs)
    pre_step = PreStepNorms()
    trainer = RecordingTrainer(model=model, args=transformers.TrainingArguments(**kwargs),
                               train_dataset=TokenData(2 * BATCHES), callbacks=[cb, pre_step])
    if scaler is not None:  # the GradScaler that accelerate builds for fp16 on an accelerator
        trainer.accelerator.scaler, trainer.accelerator.native_amp = scaler, True
    trainer.train()
    return trainer, model, pre_step


@pytest.fixture(scope="module")
def transformers_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    cb = gcb.TransformersCallback(report="grads/report.html")
    trainer, model, pre_step = transformers_train(out, cb)
    return trainer, model, pre_step, cb, out


def test_transformers_global_norm_equals_torch_before_clipping(transformers_run):
    trainer, model, pre_step, cb, out = transformers_run
    pre_clip = trainer.after_backward[ACCUMULATE - 1::ACCUMULATE]
    assert len(pre_clip) == OPT_STEPS
    assert cb.watch.steps["global_norm"].tolist() == pytest.approx(pre_clip, rel=REL)
    reported = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]  # clip_grad_norm_'s
    assert cb.watch.steps["global_norm"].tolist() == pytest.approx(reported, rel=REL)


def test_transformers_clipped_norm_equals_torch_after_clipping(transformers_run):
    trainer, model, pre_step, cb, out = transformers_run
    assert len(pre_step.norms) == OPT_STEPS
    assert all(n == pytest.approx(0.05, rel=1e-3) for n in pre_step.norms)  # the clip did clip
    assert cb.watch.steps["clipped_norm"].tolist() == pytest.approx(pre_step.norms, rel=REL)


def test_transformers_one_record_per_optimizer_step(transformers_run):
    trainer, model, pre_step, cb, out = transformers_run
    assert trainer.state.global_step == OPT_STEPS
    assert len(cb.watch.steps) == OPT_STEPS
    assert cb.watch.stats["step"].nunique() == OPT_STEPS


def test_transformers_names_are_the_models_own(transformers_run):
    trainer, model, pre_step, cb, out = transformers_run
    assert list(cb.watch.stats["name"].unique()) == [n for n, _ in model.named_parameters()]


def test_transformers_logs_norm_and_anomaly_count(transformers_run):
    trainer, model, pre_step, cb, out = transformers_run
    logged = [h for h in trainer.state.log_history if gcb.NORM_KEY in h]
    assert [h[gcb.NORM_KEY] for h in logged] == pytest.approx(cb.watch.steps["global_norm"].tolist(), rel=REL)
    assert [h[gcb.ANOMALIES_KEY] for h in logged] == [0.0] * OPT_STEPS
    assert [h["step"] for h in logged] == list(range(1, OPT_STEPS + 1))


def test_transformers_logs_what_log_to_logs(transformers_run):
    """The trainer's logs get the set that watch(log_to=...) streams: the loss handed to
    backward(), the lr and the norms per top-level module, besides the global norm."""
    trainer, model, pre_step, cb, out = transformers_run
    logged = [h for h in trainer.state.log_history if gcb.NORM_KEY in h]
    assert [h["graddbg/loss"] for h in logged] == pytest.approx(cb.watch.steps["loss"].tolist(), rel=REL)
    assert [h["graddbg/lr"] for h in logged] == pytest.approx([1e-3] * OPT_STEPS)
    modules = {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert all({f"graddbg/norm/{m}" for m in modules} <= set(h) for h in logged), (modules, sorted(logged[0]))


def test_transformers_report_written_into_the_output_dir(transformers_run):
    trainer, model, pre_step, cb, out = transformers_run
    path = out / "grads" / "report.html"
    assert cb.report_path() == path
    assert "<html" in path.read_text()[:2000].lower()


def test_transformers_watch_closed_and_model_clean_after_train(transformers_run):
    trainer, model, pre_step, cb, out = transformers_run
    assert "closed" in repr(cb.watch)
    assert hook_census(model) == hook_census(tiny_gpt2())


def test_transformers_amp_scaler_is_picked_up(tmp_path):
    """accelerate's fp16 GradScaler (made on the CPU here, as accelerate makes it on an
    accelerator) reaches the watch through the AcceleratedOptimizer: statistics of the
    unscaled gradients, the scale recorded."""
    cb = gcb.TransformersCallback()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    trainer, model, pre_step = transformers_train(tmp_path, cb, scaler=scaler, fp16=True)
    steps = cb.watch.steps
    assert steps["scale"].tolist() == [1024.0] * OPT_STEPS
    scaled = trainer.after_backward[ACCUMULATE - 1::ACCUMULATE]
    assert steps["global_norm"].tolist() == pytest.approx([n / 1024.0 for n in scaled], rel=1e-4)
    assert steps["clipped_norm"].tolist() == pytest.approx(pre_step.norms, rel=1e-4)


# --------------------------------------------------------------------------- DDP
DDP_SCRIPT = """
import json, os, sys, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as L
import graddbg.callbacks as gcb

out = sys.argv[1]

def gnorm(ps):
    gs = [p.grad for p in ps if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in gs])))

class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.pre = []
    def forward(self, x):
        return self.net(x)
    def training_step(self, batch, i):
        return nn.functional.mse_loss(self(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
    def on_before_optimizer_step(self, opt):
        self.pre.append(gnorm(self.parameters()))

class Dump(L.Callback):
    def __init__(self, cb):
        self.cb = cb
    def on_train_end(self, trainer, m):
        w = self.cb.watch
        with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"graddbg": w.steps["global_norm"].tolist(), "torch": m.pre,
                       "names": list(w.stats["name"].unique()), "own": [n for n, _ in m.named_parameters()]}, f)

if __name__ == "__main__":
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    cb = gcb.LightningCallback(report=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, gradient_clip_val=0.5,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        logger=False, default_root_dir=out, callbacks=[Dump(cb), cb])
    trainer.fit(M(), DataLoader(TensorDataset(x, 10 * x[:, :1]), batch_size=4))
"""


@pytest.mark.slow
def test_lightning_ddp_spawn_two_processes(tmp_path):
    """A real two-process DDP run (gloo): on each rank the norms are torch's (of the
    all-reduced gradients), the names the module's own, the report written once."""
    script = tmp_path / "ddp_fit.py"
    script.write_text(DDP_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert len(rank["torch"]) == 4
        assert rank["graddbg"] == pytest.approx(rank["torch"], rel=REL)
        assert rank["names"] == rank["own"]
    assert ranks[0]["torch"] == pytest.approx(ranks[1]["torch"], rel=REL)
    assert (tmp_path / "report.html").exists()


# --------------------------------------------------------------------------- construction
CALLBACKS = ["LightningCallback", "TransformersCallback"]
BAD = [
    ({"every": 0}, ValueError, r"Callback\(every=...\): got 0; accepted: an int >= 1"),
    ({"nonfinite": "explode"}, ValueError, r"Callback\(nonfinite=...\): got 'explode'"),
    ({"histograms": "often"}, TypeError, r"Callback\(histograms=...\): got 'often' \(str\); accepted: None, a bool or an int"),
    ({"evrey": 2}, TypeError, r"unknown keyword\(s\) \['evrey'\] \(did you mean 'every'\?\)"),
    ({"ddp_check_every": 0}, ValueError, r"Callback\(ddp_check_every=...\): got 0; accepted: None, 'auto' or an int >= 1"),
    ({"ddp_timeout": "1m"}, TypeError, r"Callback\(ddp_timeout=...\): got '1m' \(str\)"),
    ({"model": nn.Linear(1, 1)}, TypeError, r"\(model=...\): the model and optimizer are the trainer's"),
    ({"report": 3}, TypeError, r"\(report=...\): expected a bool or a path"),
]


@pytest.mark.parametrize("name", CALLBACKS)
@pytest.mark.parametrize("kwargs,error,match", BAD, ids=[next(iter(k)) for k, _, _ in BAD])
def test_bad_options_raise_at_construction(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        getattr(gcb, name)(**kwargs)


@pytest.mark.parametrize("kwargs", [{"every": 0}, {"nonfinite": "explode"}, {"histograms": "often"}])
def test_construction_raises_what_watch_raises(kwargs):
    with pytest.raises(Exception) as by_watch:
        graddbg.watch(nn.Linear(1, 1), **kwargs)
    with pytest.raises(type(by_watch.value)) as by_callback:
        gcb.LightningCallback(**kwargs)
    # the same message, naming the call the user made
    assert str(by_callback.value) == str(by_watch.value).replace("watch(", "LightningCallback(", 1)


def test_ddp_check_every_waits_for_the_trainers_process_group():
    cb = gcb.LightningCallback(ddp_check_every=10)  # no process group yet: the trainer starts it
    assert cb.watch is None


def test_classes_subclass_the_frameworks_callbacks():
    assert issubclass(gcb.LightningCallback, L.Callback)
    assert issubclass(gcb.TransformersCallback, transformers.TrainerCallback)
    assert gcb.LightningCallback is gcb.LightningCallback  # built once
    assert gcb.LightningCallback.__module__ == "graddbg.callbacks"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        gcb.Nope


def test_importing_callbacks_imports_no_trainer():
    code = ("import sys, graddbg.callbacks; "
            "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_callback_pickles_by_reference():
    import pickle

    cb = gcb.TransformersCallback(every=2)
    back = pickle.loads(pickle.dumps(cb))
    assert type(back) is gcb.TransformersCallback and back._watch_kwargs == {"every": 2}


# --------------------------------------------------------------------------- resuming (issue 33 point 6)
class DeadBranch(TinyModule):
    """TinyModule with a branch whose loss weight is 0: its gradients are exactly zero, so
    dead_grad fires once (after 5 recorded steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y) + 0.0 * self.branch(x).sum()


def test_lightning_resume_restores_the_watch_state(tmp_path):
    first = gcb.LightningCallback(dead_grad="record")
    trainer, _ = lightning_fit(tmp_path / "a", first, DeadBranch(), max_epochs=2, enable_checkpointing=True)
    assert [a.kind for a in first.watch.anomalies] == ["dead_grad"]
    ckpt = trainer.checkpoint_callback.best_model_path
    assert ckpt and torch.load(ckpt, weights_only=False)["callbacks"], "the callback's state is in the checkpoint"
    resumed = gcb.LightningCallback(dead_grad="record")
    lightning_fit(tmp_path / "b", resumed, DeadBranch(), max_epochs=4, enable_checkpointing=True, ckpt_path=ckpt)
    assert int(resumed.watch.steps["step"].min()) == 2 * OPT_STEPS  # the step count goes on
    assert resumed.watch.anomalies == []  # the finding made before the checkpoint is not made again
    fresh = gcb.LightningCallback(dead_grad="record")  # the control: the same resume without graddbg's state fires again
    fresh.load_state_dict({})
    lightning_fit(tmp_path / "c", fresh, DeadBranch(), max_epochs=4, ckpt_path=None)
    assert [a.kind for a in fresh.watch.anomalies] == ["dead_grad"]


def test_transformers_resume_restores_the_watch_state(tmp_path):
    first = gcb.TransformersCallback()
    transformers_train(tmp_path, first, save_strategy="steps", save_steps=OPT_STEPS)
    saved = tmp_path / f"checkpoint-{OPT_STEPS}" / gcb.STATE_NAME
    assert saved.is_file()
    level = first.watch.state_dict()["checks"]["ExplodeCheck"]["level"]
    resumed = gcb.TransformersCallback()
    trainer = RecordingTrainer(model=tiny_gpt2(), args=transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=ACCUMULATE,
        max_steps=2 * OPT_STEPS, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        learning_rate=1e-3, lr_scheduler_type="constant", seed=0),
        train_dataset=TokenData(4 * BATCHES), callbacks=[resumed])
    trainer.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{OPT_STEPS}"))
    assert int(resumed.watch.steps["step"].min()) == OPT_STEPS
    restored = resumed.watch.state_dict()["checks"]["ExplodeCheck"]["level"]
    assert restored[:len(level)] == level  # Explode's running level went on from the checkpoint's
