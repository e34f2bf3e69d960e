"""The silent training bugs of issue 23 (point 1) as data: small factories, each a buggy
training loop or its fixed twin, with the finding graddbg should make of it.

Each ``make_<case>(seed=0) -> Case``. ``Case.run(watch_kwargs)`` builds the model and the
optimizer, runs the loop inside ``graddbg.watch(model, opt, **watch_kwargs)`` and returns
the watch; ``Case.train()`` runs the same loop unwatched (what ``Case.standalone()``, a
script for ``graddbg run``, calls). For a buggy case, ``kind`` is the finding's
``Anomaly.kind``, ``params`` the parameters it must name (``Anomaly.name`` is one of them),
and ``first_step``..``last_step`` the steps (graddbg's 0-based optimizer steps) where it may
be reported: ``first_step`` is the first step at which the bug has happened and can be seen;
checks that need "several steps" of evidence (no_update, dead_grad) may report it up to
``last_step``. Twins have ``kind=None``: no anomaly and no warning.

The real reports these mimic (see /work/shared/USER-PAIN.md, items 21-23, and issue 23):
- stale_grad: zero_grad() missing (Stack Overflow 60335387 and countless forum posts; the
  TrainCheck study, OSDI 2025, "Training with Confidence");
- empty_step: zero_grad() between backward() and step(), step() before backward()
  (Stack Overflow 60335387 and forum threads; TrainCheck);
- orphan_param: BatchNorm layers left out of the optimizer while the frozen layers were
  passed in (PyTorch forum thread 84911); a head replaced after the optimizer was built;
- no_update: a param group whose lr is 0 (a scheduler or a name-keyed dict mistake), a
  compiled or wrapped optimizer step that silently skips some parameters (pytorch issue
  115607);
- dead_grad: dying ReLU (a layer whose units all died gives exactly zero gradients);
- unused_param: a ``.detach()`` in forward, so a layer never gets a gradient.
"""
from __future__ import annotations

import dataclasses
import pathlib
import textwrap
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

TESTS = pathlib.Path(__file__).resolve().parent

Built = Tuple[nn.Module, torch.optim.Optimizer]


@dataclasses.dataclass
class Case:
    name: str
    kind: Optional[str]  # the expected Anomaly.kind; None for a fixed twin
    steps: int
    build: Callable[[int], Built]  # seed -> (model, optimizer), at the point the watch starts
    loop: Callable[[nn.Module, torch.optim.Optimizer, int, int], List[float]]  # (model, opt, steps, seed) -> losses
    seed: int = 0
    params: Tuple[str, ...] = ()  # parameters the finding names (Anomaly.name is one of them)
    first_step: Optional[int] = None  # first step at which the finding may be reported
    last_step: Optional[int] = None  # last step at which it may first be reported
    mimics: str = ""

    def run(self, watch_kwargs: Optional[Dict[str, Any]] = None) -> Any:
        """Build, then run the loop inside graddbg.watch(model, opt, **watch_kwargs)."""
        import graddbg

        model, opt = self.build(self.seed)
        with graddbg.watch(model, opt, **(watch_kwargs or {})) as w:
            self.loop(model, opt, self.steps, self.seed)
        return w

    def train(self) -> List[float]:
        """The same loop, unwatched (the standalone script's body)."""
        model, opt = self.build(self.seed)
        return self.loop(model, opt, self.steps, self.seed)

    def standalone(self) -> str:
        """A script that runs this case unwatched, for ``graddbg run``; prints its losses."""
        return textwrap.dedent(f"""\
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            import silent_bugs

            case = silent_bugs.CASES[{self.name!r}]({self.seed})
            for i, loss in enumerate(case.train()):
                print(f"loss {{i}} {{loss:.8e}}")
            """)


# --------------------------------------------------------------------------- models and data

def _mlp(seed: int, d_in: int = 8, hidden: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def _batch(gen: torch.Generator, n: int = 32, d_in: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, d_in, generator=gen)
    return x, torch.sin(x.sum(1, keepdim=True))


def _sgd(model: nn.Module, lr: float = 0.05) -> Built:
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def _standard(model, opt, steps, seed) -> List[float]:
    """The healthy loop: zero_grad, forward, backward, step."""
    gen, losses = torch.Generator().manual_seed(seed + 1), []
    for _ in range(steps):
        x, y = _batch(gen)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


MLP_PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")


# --------------------------------------------------------------------------- stale_grad

def _no_zero_grad(model, opt, steps, seed) -> List[float]:
    gen, losses = torch.Generator().manual_seed(seed + 1), []
    for _ in range(steps):
        x, y = _batch(gen)
        loss = F.mse_loss(model(x), y)  # bug: no opt.zero_grad(): each step applies the sum of all gradients
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _zero_grad_keep_tensors(model, opt, steps, seed) -> List[float]:
    gen, losses = torch.Generator().manual_seed(seed + 1), []
    for _ in range(steps):
        x, y = _batch(gen)
        opt.zero_grad(set_to_none=False)  # zeros in place: the gradient tensors survive, their values do not
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _accumulate_4(model, opt, steps, seed) -> List[float]:
    gen, losses = torch.Generator().manual_seed(seed + 1), []
    for _ in range(steps):
        for _micro in range(4):  # gradient accumulation: 4 backward passes per step, on purpose
            x, y = _batch(gen, n=8)
            loss = F.mse_loss(model(x), y) / 4
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def make_stale_grad(seed: int = 0) -> Case:
    """zero_grad() missing: the gradient of step 0 survives the optimizer step into step 1's
    backward (step 1 applies the sum of both): reported at step 1, naming every parameter."""
    return Case("stale_grad", "stale_grad", 6, lambda s: _sgd(_mlp(s)), _no_zero_grad, seed,
                params=MLP_PARAMS, first_step=1, last_step=1,
                mimics="zero_grad() missing: Stack Overflow 60335387, forum threads, TrainCheck")


def make_stale_grad_twin(seed: int = 0) -> Case:
    return Case("stale_grad_twin", None, 6, lambda s: _sgd(_mlp(s)), _standard, seed)


def make_stale_grad_twin_zeros(seed: int = 0) -> Case:
    """zero_grad(set_to_none=False): the gradient tensors stay (zeroed in place): healthy."""
    return Case("stale_grad_twin_zeros", None, 6, lambda s: _sgd(_mlp(s)), _zero_grad_keep_tensors, seed)


def make_stale_grad_twin_accumulation(seed: int = 0) -> Case:
    """Gradient accumulation over 4 micro-batches per step, zero_grad after the step: NOT a
    stale gradient (several backward passes per step, none surviving a step)."""
    return Case("stale_grad_twin_accumulation", None, 5, lambda s: _sgd(_mlp(s)), _accumulate_4, seed)


# --------------------------------------------------------------------------- empty_step

def _zero_grad_before_step(model, opt, steps, seed) -> List[float]:
    gen, losses = torch.Generator().manual_seed(seed + 1), []
    for _ in range(steps):
        x, y = _batch(gen)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.zero_grad()  # bug: between backward and step: the step has no gradient
        opt.step()
        losses.append(loss.item())
    return losses


def _step_before_backward(model, opt, steps, seed) -> List[float]:
    gen, losses = torch.Generator().manual_seed(seed + 1), []
    for _ in range(steps):
        x, y = _batch(gen)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        opt.step()  # bug: before backward: this step's gradients do not exist yet
        loss.backward()
        losses.append(loss.item())
    return losses


def make_empty_step_zero_grad_between(seed: int = 0) -> Case:
    """zero_grad() between backward() and step(): every step has no gradient although
    backward computed them; reported at step 0, naming every parameter."""
    return Case("empty_step_zero_grad_between", "empty_step", 5, lambda s: _sgd(_mlp(s)),
                _zero_grad_before_step, seed, params=MLP_PARAMS, first_step=0, last_step=2,
                mimics="zero_grad() misplaced: Stack Overflow 60335387, forum threads, TrainCheck")


def make_empty_step_before_backward(seed: int = 0) -> Case:
    """step() before backward(): at step 0 the step runs before any backward of that step
    (every gradient None; the gradients of that backward are then zeroed by the next
    zero_grad before any step uses them); reported at step 0, naming every parameter."""
    return Case("empty_step_before_backward", "empty_step", 5, lambda s: _sgd(_mlp(s)),
                _step_before_backward, seed, params=MLP_PARAMS, first_step=0, last_step=2,
                mimics="step() before backward(): Stack Overflow 60335387, forum threads, TrainCheck")


def make_empty_step_twin(seed: int = 0) -> Case:
    return Case("empty_step_twin", None, 5, lambda s: _sgd(_mlp(s)), _standard, seed)


# --------------------------------------------------------------------------- orphan_param

class _Net(nn.Module):
    """body (Linear + BatchNorm) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.body(x))))


def _replaced_head(seed: int) -> Built:
    torch.manual_seed(seed)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.head = nn.Linear(16, 1)  # bug: replaced after the optimizer was built: the new head is in no group
    return model, opt


def _rebuilt_optimizer(seed: int) -> Built:
    torch.manual_seed(seed)
    model = _Net()
    model.head = nn.Linear(16, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _bn_left_out(seed: int) -> Built:
    torch.manual_seed(seed)
    model = _Net()
    model.body.requires_grad_(False)  # the frozen layers ...
    # bug (forum thread 84911): ... are passed in, and the trainable BatchNorm is left out
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("bn.")], lr=0.05)
    return model, opt


def _frozen_body_trainable_rest(seed: int) -> Built:
    torch.manual_seed(seed)
    model = _Net()
    model.body.requires_grad_(False)
    return model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)


def _frozen_body_passed_in(seed: int) -> Built:
    """A healthy habit: the whole model given to the optimizer, the frozen body included
    (frozen parameters get no gradient, so the optimizer skips them)."""
    torch.manual_seed(seed)
    model = _Net()
    model.body.requires_grad_(False)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def make_orphan_param_replaced_head(seed: int = 0) -> Case:
    """A head replaced after the optimizer was built: head.weight and head.bias get
    gradients at every step but belong to no param group; reported at step 0."""
    return Case("orphan_param_replaced_head", "orphan_param", 5, _replaced_head, _standard, seed,
                params=("head.weight", "head.bias"), first_step=0, last_step=2,
                mimics="a head replaced after the optimizer was built (USER-PAIN 21, TrainCheck)")


def make_orphan_param_bn_left_out(seed: int = 0) -> Case:
    """BatchNorm left out of the optimizer while the frozen layers were passed in: bn.weight
    and bn.bias get gradients but belong to no param group; reported at step 0."""
    return Case("orphan_param_bn_left_out", "orphan_param", 5, _bn_left_out, _standard, seed,
                params=("bn.weight", "bn.bias"), first_step=0, last_step=2,
                mimics="PyTorch forum thread 84911: BatchNorm left out, frozen layers passed in")


def make_orphan_param_twin(seed: int = 0) -> Case:
    """The optimizer rebuilt after the head was replaced."""
    return Case("orphan_param_twin", None, 5, _rebuilt_optimizer, _standard, seed)


def make_orphan_param_twin_frozen(seed: int = 0) -> Case:
    """A frozen body left out of the optimizer, every trainable parameter in it."""
    return Case("orphan_param_twin_frozen", None, 5, _frozen_body_trainable_rest, _standard, seed)


def make_orphan_param_twin_frozen_passed_in(seed: int = 0) -> Case:
    """A frozen body passed in with the rest: no gradient, nothing orphaned."""
    return Case("orphan_param_twin_frozen_passed_in", None, 5, _frozen_body_passed_in, _standard, seed)


# --------------------------------------------------------------------------- no_update

class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _lr_zero_group(seed: int) -> Built:
    torch.manual_seed(seed)
    model = _Body()
    lrs = {"head": 0.05}  # bug: a name-keyed dict of learning rates that misses "body": lr 0
    groups = [{"params": list(getattr(model, n).parameters()), "lr": lrs.get(n, 0.0)} for n in ("body", "head")]
    return model, torch.optim.SGD(groups, lr=0.05)


def _two_groups(seed: int) -> Built:
    torch.manual_seed(seed)
    model = _Body()
    groups = [{"params": list(model.body.parameters()), "lr": 0.01}, {"params": list(model.head.parameters())}]
    return model, torch.optim.SGD(groups, lr=0.05)


class SkipLastGroupSGD(torch.optim.Optimizer):
    """A hand-written SGD with an off-by-one: it never steps its last param group (a
    wrapper or a compiled step that silently skips some parameters, pytorch issue 115607)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups[:-1]:  # bug: [:-1]
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def _skipping_step(seed: int) -> Built:
    torch.manual_seed(seed)
    model = _Body()
    groups = [{"params": list(model.head.parameters())}, {"params": list(model.body.parameters())}]
    return model, SkipLastGroupSGD(groups, lr=0.05)


def _warmup_from_zero(seed: int) -> Built:
    torch.manual_seed(seed)
    model = _Body()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _warmup_loop(model, opt, steps, seed) -> List[float]:
    """Linear warm-up from lr 0 (transformers' get_linear_schedule_with_warmup): the first
    step leaves every parameter unchanged, on purpose."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 3))
    gen, losses = torch.Generator().manual_seed(seed + 1), []
    for _ in range(steps):
        x, y = _batch(gen)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


NO_UPDATE_STEPS = 10  # "several steps": the finding may come at any step up to 5


def make_no_update_lr_zero(seed: int = 0) -> Case:
    """A param group with lr=0 by mistake: body.weight and body.bias have non-zero gradients
    and stay unchanged from step 0 on; reported once, at a step in 0..5."""
    return Case("no_update_lr_zero", "no_update", NO_UPDATE_STEPS, _lr_zero_group, _standard, seed,
                params=("body.weight", "body.bias"), first_step=0, last_step=5,
                mimics="a param group whose lr is 0 (USER-PAIN 21, TrainCheck)")


def make_no_update_skipped_group(seed: int = 0) -> Case:
    """An optimizer step that skips its last group (body): reported once, at a step in 0..5."""
    return Case("no_update_skipped_group", "no_update", NO_UPDATE_STEPS, _skipping_step, _standard, seed,
                params=("body.weight", "body.bias"), first_step=0, last_step=5,
                mimics="a step that silently skips parameters: pytorch issue 115607")


def make_no_update_twin(seed: int = 0) -> Case:
    return Case("no_update_twin", None, NO_UPDATE_STEPS, _two_groups, _standard, seed)


def _bias_before_bn(seed: int) -> Built:
    torch.manual_seed(seed)
    model = _Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def make_no_update_twin_bias_before_bn(seed: int = 0) -> Case:
    """A Linear's bias right before a BatchNorm (train mode): BatchNorm removes the mean, so
    body.bias's gradient is zero up to rounding (about 1e-9, not exactly 0) and SGD leaves
    it unchanged in float32 at every step. Healthy (the standard conv/linear + BN layout):
    a non-zero gradient that the step does not apply must not be a no_update finding here."""
    return Case("no_update_twin_bias_before_bn", None, NO_UPDATE_STEPS, _bias_before_bn, _standard, seed)


def make_no_update_twin_warmup(seed: int = 0) -> Case:
    """Warm-up from lr 0: one step without a change is not "several"."""
    return Case("no_update_twin_warmup", None, NO_UPDATE_STEPS, _warmup_from_zero, _warmup_loop, seed)


# --------------------------------------------------------------------------- dead_grad

class _ReLUNet(nn.Module):
    """A ReLU layer and a head that also sees the input (a skip connection), so that when
    the layer dies only its own parameters lose their gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, 32)
        self.head = nn.Linear(32 + 8, 1)

    def forward(self, x):
        return self.head(torch.cat([F.relu(self.hidden(x)), x], 1))


def _relu_net(seed: int) -> Built:
    torch.manual_seed(seed)
    model = _ReLUNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


DEATH_STEP = 3


def _dying_loop(model, opt, steps, seed) -> List[float]:
    """Healthy until step DEATH_STEP, when one bad update pushes hidden.bias far negative
    (a learning-rate spike on it): every ReLU of `hidden` is dead for every input from then
    on, so hidden.weight and hidden.bias get exactly zero gradients (the head keeps
    learning from the skip connection)."""
    gen, losses = torch.Generator().manual_seed(seed + 1), []
    for i in range(steps):
        if i == DEATH_STEP:
            with torch.no_grad():
                model.hidden.bias.sub_(1000.0)  # bug: the push that kills the layer
        x, y = _batch(gen)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def make_dead_grad(seed: int = 0) -> Case:
    """Every ReLU of `hidden` dies at step 3: hidden.weight's and hidden.bias's gradients
    are exactly zero from step 3 on after being non-zero; reported once, at a step in 3..8,
    naming the layer `hidden` and its parameters."""
    return Case("dead_grad", "dead_grad", 12, _relu_net, _dying_loop, seed,
                params=("hidden.weight", "hidden.bias"), first_step=DEATH_STEP,
                last_step=DEATH_STEP + 5, mimics="dying ReLU (USER-PAIN 23)")


def make_dead_grad_twin(seed: int = 0) -> Case:
    """The same ReLU net, no push: some units are inactive on some inputs, none dead."""
    return Case("dead_grad_twin", None, 12, _relu_net, _standard, seed)


# --------------------------------------------------------------------------- unused_param

class _Detached(nn.Module):
    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.detach = detach
        self.encoder = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.encoder(x))
        if self.detach:
            h = h.detach()  # bug: the encoder never gets a gradient
        return self.head(h)


def _detached(seed: int, detach: bool = True) -> Built:
    torch.manual_seed(seed)
    model = _Detached(detach)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def make_unused_param(seed: int = 0) -> Case:
    """A .detach() in forward: encoder.weight and encoder.bias never receive a gradient;
    reported once, from step 0 (the first step that shows it) and at the latest at the last
    step (4: when the watch closes)."""
    return Case("unused_param", "unused_param", 5, _detached, _standard, seed,
                params=("encoder.weight", "encoder.bias"), first_step=0, last_step=4,
                mimics="a .detach() in forward (issue 23 point 1; USER-PAIN 6)")


def make_unused_param_twin(seed: int = 0) -> Case:
    return Case("unused_param_twin", None, 5, lambda s: _detached(s, detach=False), _standard, seed)


# --------------------------------------------------------------------------- the registry

CASES: Dict[str, Callable[[int], Case]] = {
    f.__name__[len("make_"):]: f for f in (
        make_stale_grad, make_stale_grad_twin, make_stale_grad_twin_zeros, make_stale_grad_twin_accumulation,
        make_empty_step_zero_grad_between, make_empty_step_before_backward, make_empty_step_twin,
        make_orphan_param_replaced_head, make_orphan_param_bn_left_out, make_orphan_param_twin,
        make_orphan_param_twin_frozen, make_orphan_param_twin_frozen_passed_in,
        make_no_update_lr_zero, make_no_update_skipped_group, make_no_update_twin, make_no_update_twin_warmup,
        make_no_update_twin_bias_before_bn,
        make_dead_grad, make_dead_grad_twin,
        make_unused_param, make_unused_param_twin)
}
BUGGY = [n for n, f in CASES.items() if f().kind is not None]
TWINS = [n for n, f in CASES.items() if f().kind is None]
KINDS = ("stale_grad", "empty_step", "orphan_param", "no_update", "dead_grad", "unused_param")
