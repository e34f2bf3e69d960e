"""The graddbg command line, run as a user runs it: in subprocesses."""
from __future__ import annotations

import html.parser
import pathlib
import subprocess
import sys

import pytest
import torch

import graddbg
from graddbg import cli

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def _graddbg(*args, cwd=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "graddbg", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)


class _Collector(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list = []
        self.text: list = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def _parse(path: pathlib.Path) -> _Collector:
    p = _Collector()
    p.feed(path.read_text(encoding="utf-8"))
    return p


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    res = _graddbg("demo", "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out"
    for f in ("report.html", "graph.svg", "stats.parquet"):
        assert (out / f).stat().st_size > 1000, f
    assert "module norm, op aten.div" in res.stdout  # the planted 0/0 is caught where it is
    assert "explode" in res.stdout and "step   81" in res.stdout  # the lr spike, the step after
    assert str(out / "report.html") in res.stdout
    page = _parse(out / "report.html")
    assert "svg" in page.tags and "table" in page.tags
    assert "nonfinite" in " ".join(page.text)
    run = graddbg.load(out / "stats.parquet")
    assert {a.kind for a in run.anomalies} >= {"nonfinite", "explode"}
    assert (out / "graph.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


def test_run_script_with_nan_exits_1_and_report_names_module(tmp_path):
    res = _graddbg("run", "--out", str(tmp_path), str(SCRIPTS / "nan_train.py"), "6")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "stopped by graddbg" in res.stderr and "module 'logs'" in res.stderr
    text = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "logs" in text and "aten.log" in text
    run = graddbg.load(tmp_path / "stats.parquet")
    assert run.anomalies[0].module == "logs" and run.anomalies[0].step == 3
    assert sorted(run.stats["step"].unique()) == [0, 1, 2, 3]  # nothing lost before the crash


def test_run_healthy_script_exits_0_and_passes_arguments(tmp_path):
    res = _graddbg("run", "--out", str(tmp_path), "--every", "2", str(SCRIPTS / "healthy_train.py"))
    assert res.returncode == 0, res.stderr
    assert "ok" in res.stdout and "0 anomalies" in res.stdout
    run = graddbg.load(tmp_path / "stats.parquet")
    assert sorted(run.stats["step"].unique()) == [0, 2, 4]
    assert run.stats["name"].unique().tolist() == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_run_record_policy_and_fail_on_never(tmp_path):
    res = _graddbg("run", "--out", str(tmp_path), "--nonfinite", "record", "--fail-on", "never",
                   str(SCRIPTS / "nan_train.py"))
    assert res.returncode == 0, res.stderr
    assert "trained 6" in res.stdout and "nonfinite" in res.stdout


def test_report_renders_a_saved_run(tmp_path):
    model = torch.nn.Linear(3, 1)
    with graddbg.watch(model) as w:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
    w.save(tmp_path / "run.parquet")
    res = _graddbg("report", str(tmp_path / "run.parquet"), "--out", str(tmp_path / "r.html"))
    assert res.returncode == 0, res.stderr
    page = _parse(tmp_path / "r.html")
    assert "svg" in page.tags and "weight" in " ".join(page.text)


@pytest.mark.parametrize("args,message", [
    (["run", "missing_script.py"], "script: 'missing_script.py' does not exist"),
    (["run", "--every", "0", str(SCRIPTS / "healthy_train.py")], "--every must be >= 1, got 0"),
    (["run", "--nonfinite", "explode", "x.py"], "invalid choice: 'explode'"),
    (["report", "nope.parquet"], "run: 'nope.parquet' does not exist"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "usage: graddbg"),
])
def test_usage_errors_exit_2(args, message, capsys):
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_run_leaves_no_global_hooks(tmp_path):
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optim_mod

    before = (len(module_mod._global_forward_hooks), len(module_mod._global_forward_pre_hooks),
              len(optim_mod._global_optimizer_pre_hooks))
    code = cli.run_script(str(SCRIPTS / "healthy_train.py"), [], out=str(tmp_path))
    assert code == 0
    after = (len(module_mod._global_forward_hooks), len(module_mod._global_forward_pre_hooks),
             len(optim_mod._global_optimizer_pre_hooks))
    assert before == after


def test_quickstart_example_prints_the_summary_table():
    res = subprocess.run([sys.executable, str(SCRIPTS.parent.parent / "examples" / "quickstart.py")],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["name", "numel", "norm_mean"]
    assert [line.split()[0] for line in lines[1:7]] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert "100 steps" in res.stdout and "anomalies: 0" in res.stdout
