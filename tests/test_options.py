"""The one validation helper set (graddbg._args), Schedule, and the options objects built on
them: WatchOptions, gradcheck's options, the detectors and the cross-rank checks' arguments
all raise the same message, naming the call, the option, what was given and what is
accepted."""
from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch

import graddbg
from graddbg import _args
from graddbg._args import AUTO, Schedule
from graddbg._errors import GraddbgTypeError, GraddbgValueError
from graddbg.options import WatchOptions


# --------------------------------------------------------------------------- validators
@pytest.mark.parametrize("check, value, error, message", [
    (_args.count, 0, GraddbgValueError, "f(n=...): got 0; accepted: an int >= 1"),
    (_args.count, True, GraddbgTypeError, "f(n=...): got True (bool); accepted: an int >= 1"),
    (_args.count, 2.0, GraddbgTypeError, "f(n=...): got 2.0 (float); accepted: an int >= 1"),
    (_args.flag, "yes", GraddbgTypeError, "f(n=...): got 'yes' (str); accepted: True or False"),
    (_args.flag, 2, GraddbgTypeError, "f(n=...): got 2 (int); accepted: True or False"),
    (_args.tolerance, -0.5, GraddbgValueError, "f(n=...): got -0.5; accepted: a finite number >= 0"),
    (_args.tolerance, math.inf, GraddbgValueError, "f(n=...): got inf; accepted: a finite number >= 0"),
    (_args.tolerance, 10 ** 400, GraddbgValueError, "f(n=...): got " + str(10 ** 400)
     + "; accepted: a finite number >= 0"),
    (_args.tolerance, "0", GraddbgTypeError, "f(n=...): got '0' (str); accepted: a finite number >= 0"),
    (_args.duration, 0, GraddbgValueError, "f(n=...): got 0; accepted: a positive duration"),
    (_args.duration, timedelta(0), GraddbgValueError, "f(n=...): got 0:00:00; accepted: a positive duration"),
    (_args.duration, math.nan, GraddbgValueError, "f(n=...): got nan; accepted: a positive duration"),
    (_args.duration, "60", GraddbgTypeError, "f(n=...): got '60' (str); accepted: a datetime.timedelta"),
    (_args.duration, True, GraddbgTypeError, "f(n=...): got True (bool); accepted: a datetime.timedelta"),
])
def test_a_bad_value_names_the_call_the_option_what_was_given_and_what_is_accepted(check, value, error, message):
    with pytest.raises(error) as info:
        check("f", "n", value)
    assert str(info.value).startswith(message)
    assert isinstance(info.value, ValueError if error is GraddbgValueError else TypeError)


def test_good_values_come_back_normalised():
    assert _args.count("f", "n", 3) == 3
    assert _args.flag("f", "n", 1) is True and _args.flag("f", "n", False) is False
    assert _args.tolerance("f", "n", 1) == 1.0 and isinstance(_args.tolerance("f", "n", 1), float)
    assert _args.duration("f", "n", 2.5) == timedelta(seconds=2.5)
    assert _args.duration("f", "n", timedelta(minutes=1)) == timedelta(minutes=1)
    assert _args.choice("f", "n", "b", ("a", "b")) == "b"
    assert _args.optional(_args.count)("f", "n", None) is None
    assert _args.integer("f", "n", -3) == -3
    with pytest.raises(GraddbgValueError, match=r"^f\(n=...\): got 'c'; accepted: 'a', 'b'$"):
        _args.choice("f", "n", "c", ("a", "b"))
    with pytest.raises(GraddbgValueError, match=r"accepted: a finite number > 0 \(or None for the default: x\)$"):
        _args.tolerance("f", "n", 0, positive=True, default="x")


# --------------------------------------------------------------------------- Schedule
def test_a_schedule_includes_the_first_step_and_every_nth_after():
    assert [i for i in range(10) if Schedule(3).includes(i)] == [0, 3, 6, 9]
    assert all(Schedule(1).includes(i) for i in range(5)) and Schedule().on
    off = Schedule(None)
    assert not off.on and not any(off.includes(i) for i in range(5))
    # every 10th of the steps that every=2 includes: every 20th step
    assert Schedule(10).within(Schedule(2)) == Schedule(20)
    log = [i for i in range(1000) if Schedule.log().includes(i)]
    assert log == [0, 1, 2, 5, 10, 20, 50, 100, 200, 400, 600, 800]
    assert Schedule(10).within(Schedule(None)) == Schedule(None) == Schedule(None).within(Schedule(2))


def test_watch_options_read_every_cadence_as_a_schedule():
    opts = WatchOptions.parse("watch", {"every": 2, "histograms": 4, "update_every": 6,
                                        "nonfinite": graddbg.NonFinite(every=3)})
    assert opts.record_schedule == Schedule(2) and opts.histogram_schedule == Schedule(4)
    assert opts.update_schedule == Schedule(6) and opts.nonfinite.schedule == Schedule(3)
    assert opts.absmax_cpu_schedule == Schedule(20)       # every 10th recorded step on the CPU
    named = WatchOptions.parse("watch", {"every": 2, "stats": ("norm", "absmax")})
    assert named.absmax_cpu_schedule == Schedule(2)       # asked for by name: every recorded step
    assert WatchOptions.parse("watch", {"update_every": None}).update_schedule == Schedule(None)
    # the default: the log cadence, counted in recorded steps
    assert WatchOptions().update_schedule == Schedule.log() == Schedule(200, (1, 2, 5, 10, 20, 50, 100))
    assert WatchOptions(every=2).update_schedule == Schedule(400, (2, 4, 10, 20, 40, 100, 200))
    assert WatchOptions().histogram_schedule == Schedule(None)


def test_one_auto_sentinel():
    from graddbg import options

    assert options.AUTO is AUTO == "auto"
    assert WatchOptions().ddp_check_every is AUTO


def test_the_histograms_cadence_counts_steps_as_before():
    """histograms=N keeps its meaning: the recorded steps whose index is a multiple of N."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, every=2, histograms=3, ddp_check_every=None) as w:
        for _ in range(13):
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert sorted(set(w.histograms["step"])) == [0, 6, 12]
    assert sorted(set(w.stats["step"])) == list(range(0, 13, 2))


# --------------------------------------------------------------------------- the options objects
def test_every_options_object_speaks_the_same_message():
    with pytest.raises(GraddbgValueError) as by_watch:
        graddbg.watch(torch.nn.Linear(2, 2), history=0)
    with pytest.raises(GraddbgValueError) as by_gradcheck:
        graddbg.gradcheck(torch.sin, torch.randn(3, dtype=torch.float64, requires_grad=True), probes=0)
    with pytest.raises(GraddbgValueError) as by_detector:
        graddbg.Explode(window=0)
    assert str(by_watch.value) == "watch(history=...): got 0; accepted: an int >= 1"
    assert str(by_gradcheck.value) == "gradcheck(probes=...): got 0; accepted: an int >= 1"
    assert str(by_detector.value) == "Explode(window=...): got 0; accepted: an int >= 1"


def test_ddp_timeout_is_checked_when_watch_is_called_not_at_the_replica_check():
    """A bad ddp_timeout used to reach check_replicas at step 0, whose error switched the
    replica check off without a word; now watch() refuses it, and a good one is a timedelta."""
    with pytest.raises(GraddbgTypeError, match=r"^watch\(ddp_timeout=...\): got \[60\] \(list\)"):
        graddbg.watch(torch.nn.Linear(2, 2), ddp_timeout=[60])
    assert WatchOptions.parse("watch", {"ddp_timeout": 30}).ddp_timeout == timedelta(seconds=30)
    assert WatchOptions().ddp_timeout is None


def test_every_default_cadence_is_a_schedule_in_one_place():
    from graddbg import _args

    # the loss graph: backward passes 0, 1, 2, then the powers of ten
    assert [i for i in range(20_001) if _args.LOSS_GRAPH.includes(i)] == [0, 1, 2, 10, 100, 1000, 10_000]
    assert [i for i in range(120) if Schedule.decades(1).includes(i)] == [0, 10, 100]
    # a fused optimizer's weights: the first 5 steps, then every 10th
    assert [i for i in range(31) if _args.FUSED_WEIGHTS.includes(i)] == [0, 1, 2, 3, 4, 10, 20, 30]
    assert WatchOptions().update_schedule == _args.UPDATE_RATIOS.within(Schedule(1))
    with pytest.raises(ValueError, match="decades"):
        _args.LOSS_GRAPH.within(Schedule(2))
