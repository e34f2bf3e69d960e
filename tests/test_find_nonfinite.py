"""find_nonfinite: the op-level forensic mode. Each test plants one bug and checks the blame."""
from __future__ import annotations

import gc
import inspect
import math
import warnings
import weakref
from typing import Dict

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from graddbg._errors import GradientAnomalyError, NonFiniteError
from graddbg.blame import find_nonfinite

HERE = __file__


def _line() -> int:
    """The caller's line number."""
    return inspect.currentframe().f_back.f_lineno


def _no_hooks(model: nn.Module) -> bool:
    return all(len(m._forward_hooks) == 0 and len(m._forward_pre_hooks) == 0
               and len(m._forward_hooks_always_called) == 0 for m in model.modules())


def _no_mode() -> bool:
    return torch._C._len_torch_dispatch_stack() == 0


# -- problems as data ------------------------------------------------------------------

SQRT_LINE = [0]


class PairwiseDistances(nn.Module):
    """Distances between all points of the batch, each point to itself included:
    finite forward (sqrt(0) = 0), infinite derivative at 0 in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sq = (x[:, None, :] - x[None, :, :]).pow(2).sum(-1)
        SQRT_LINE[0] = _line() + 1
        return torch.sqrt(sq)


class PrePostNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 5)
        self.culprit = PairwiseDistances()
        self.post = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.culprit(self.pre(x)))


DIV_LINE = [0]


class RowNormalise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        DIV_LINE[0] = _line() + 1
        return x / x.sum(dim=-1, keepdim=True)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.norm = RowNormalise()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.act(self.embed(x))))


class Layer(nn.Module):
    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bad = bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if self.bad:
            h = h / torch.zeros_like(h)  # the planted bug: x / 0
        return h


class DictNet(nn.Module):
    def __init__(self, depth: int, bad: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(i == bad) for i in range(depth))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        feats = []
        for layer in self.layers:
            x = layer(x)
            feats.append(x)
        return {"logits": self.head(x), "features": tuple(feats)}


class TinyResNet(nn.Module):
    """BatchNorm, ReLU(inplace=True), an `x += shortcut` residual, a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.shortcut = nn.Conv2d(3, 8, 1, bias=False)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        out = self.relu(out)
        return self.fc(out.mean((2, 3))), out


def _tiny_transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, batch_first=True,
                                       dropout=0.0)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.LayerNorm(16))


# -- blame -----------------------------------------------------------------------------

def test_exp_overflow_names_the_op_and_this_line(device: torch.device) -> None:
    x = torch.tensor([1.0, 50.0, 100.0], device=device, requires_grad=True)
    with pytest.raises(NonFiniteError, match=r"Inf produced from finite inputs by forward "
                                             r"op aten\.exp") as info:
        with find_nonfinite():
            y = x * 2
            line = _line() + 1
            z = torch.exp(y)  # noqa: F841  (exp(200) overflows float32)
    a = info.value.anomaly
    assert a.op == "aten.exp"
    assert a.source == f"{HERE}:{line}"
    assert a.kind == "nonfinite" and a.value == math.inf
    assert a.module is None  # no model given
    assert _no_mode()


def test_sqrt_at_zero_blames_the_module_and_sqrt_backward(device: torch.device) -> None:
    torch.manual_seed(0)
    model = PrePostNet().to(device)
    x = torch.randn(6, 3, device=device)
    with find_nonfinite(model):
        out = model(x)  # the forward pass is finite: no error here
    assert torch.isfinite(out).all()
    with pytest.raises(NonFiniteError, match="backward op SqrtBackward0") as info:
        with find_nonfinite(model):
            model(x).sum().backward()
    a = info.value.anomaly
    assert a.op == "SqrtBackward0"
    assert a.module == "culprit"  # not "pre", whose gradients are NaN too
    assert a.source == f"{HERE}:{SQRT_LINE[0]}"  # the forward line that made the node
    assert a.step == 0
    assert _no_hooks(model) and _no_mode()
    # without the forensic mode the planted bug really does poison "pre"
    model.zero_grad()
    model(x).sum().backward()
    assert not torch.isfinite(model.pre.weight.grad).all()


def test_zero_over_zero_normalisation_blames_the_forward_div() -> None:
    model = NormNet()
    with torch.no_grad():
        model.embed.bias.fill_(-100.0)  # ReLU outputs an all-zero row for every sample
    with pytest.raises(NonFiniteError, match=r"NaN produced .* forward op aten\.div") as info:
        with find_nonfinite(model):
            model(torch.randn(3, 4)).sum().backward()
    a = info.value.anomaly
    assert (a.op, a.module) == ("aten.div", "norm")
    assert math.isnan(a.value)
    assert a.source == f"{HERE}:{DIV_LINE[0]}"
    assert _no_hooks(model)


@pytest.mark.parametrize("bad", [0, 2, 3])
def test_nan_in_layer_k_of_a_dict_model_blames_only_layer_k(bad: int) -> None:
    model = DictNet(depth=4, bad=bad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an exception, not a warning: filters cannot hide it
        with pytest.raises(NonFiniteError) as info:
            with find_nonfinite(model):
                out = model(torch.randn(5, 8))
                out["logits"].sum().backward()
    a = info.value.anomaly
    assert a.module == f"layers.{bad}"
    assert a.op == "aten.div"
    assert "layers.{}".format(bad) in str(info.value)
    assert _no_hooks(model)


def test_propagators_are_not_blamed_only_the_producer() -> None:
    x = torch.tensor([[0.0, 1.0], [2.0, 3.0]], requires_grad=True)
    with pytest.raises(NonFiniteError) as info:
        with find_nonfinite():
            line = _line() + 1
            a = torch.log(x)  # log(0) = -inf: the producer
            b = a * 0.0  # -inf * 0 = NaN, from a non-finite input: a propagator
            (b + 1).sum().backward()
    assert info.value.anomaly.op == "aten.log"
    assert info.value.anomaly.source == f"{HERE}:{line}"


def test_nonfinite_input_from_outside_is_never_blamed_on_later_ops() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(2, 3)
    x[0, 1] = float("nan")
    with find_nonfinite(model) as scan:
        loss = model(x).sum()
        loss.backward()
    assert math.isnan(loss.item())
    assert not torch.isfinite(model[0].weight.grad).all()  # NaN flowed all the way back
    assert scan.ops_checked > 5  # the ops were checked, and all were propagators


def test_inplace_producer_is_blamed_and_inplace_propagator_is_not() -> None:
    h = torch.tensor([1.0, 200.0])
    with pytest.raises(NonFiniteError, match=r"aten\.exp_") as info:
        with find_nonfinite():
            h.exp_()  # in place, finite before: the producer
    assert info.value.anomaly.value == math.inf
    g = torch.tensor([float("nan"), 1.0])
    with find_nonfinite():
        g.mul_(2.0)  # NaN before the op: a propagator, even though the op wrote it
        g += 1
    assert math.isnan(g[0].item()) and g[1].item() == 3.0


def test_backward_only_blames_log_backward_at_the_forward_line() -> None:
    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    with pytest.raises(NonFiniteError, match="backward op LogBackward0") as info:
        with find_nonfinite(check_forward=False):
            line = _line() + 1
            y = torch.where(x > 0, torch.log(x), torch.zeros_like(x))
            y.sum().backward()  # where's backward sends 0 to log(0): 0 / 0 = NaN
    a = info.value.anomaly
    assert (a.op, a.source) == ("LogBackward0", f"{HERE}:{line}")
    assert "forward op: aten.log" in str(info.value)
    # with the forward check on, the masked -inf of log(0) is reported where it was made
    with pytest.raises(NonFiniteError, match=r"forward op aten\.log"):
        with find_nonfinite():
            torch.where(x > 0, torch.log(x), torch.zeros_like(x))


def test_step_counts_backward_passes() -> None:
    model = nn.Sequential(nn.Linear(2, 2), RowNormalise())
    x = torch.rand(4, 2) + 0.5
    with pytest.raises(NonFiniteError) as info:
        with find_nonfinite(model):
            for step in range(4):
                if step == 2:
                    with torch.no_grad():
                        model[0].weight.zero_()
                        model[0].bias.zero_()
                model(x).sum().backward()
    assert info.value.anomaly.step == 2
    assert "(step 2)" in str(info.value)


# -- the message -------------------------------------------------------------------------

def test_message_text_for_a_real_case() -> None:
    class Body(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.exp(x)

    model = nn.Sequential(nn.Identity(), Body())
    x = torch.tensor([[1.0, -2.0, 0.0], [100.0, 0.5, 0.0]])
    with pytest.raises(NonFiniteError) as info:
        with find_nonfinite(model):
            model(x)
    lines = str(info.value).splitlines()
    body_line = inspect.getsourcelines(Body.forward)[1] + 1
    assert lines[0] == ("find_nonfinite: Inf produced from finite inputs by forward op "
                        "aten.exp (step 0).")
    assert lines[1] == "  module: 1 (Body)"
    assert lines[2] == f"  source: {HERE}:{body_line}"
    assert lines[3] == "  inputs:"
    assert lines[4] == ("    [0] (2, 3) float32 cpu: min -2 max 100 absmax 100 zeros 2 "
                        "nan 0 inf 0")
    assert lines[5] == ("  output[0]: (2, 3) float32: nan 0 +inf 1 -inf 0 of 6, "
                        "first at index (1, 0)")
    assert lines[6].startswith("  try: an overflow")
    assert len(lines) == 7


def test_message_is_bounded_for_ops_with_many_inputs() -> None:
    xs = [torch.ones(3) for _ in range(40)]
    zs = [torch.zeros(3) for _ in range(40)]
    with pytest.raises(NonFiniteError, match=r"_foreach_div") as info:
        with find_nonfinite():
            torch._foreach_div(xs, zs)
    text = str(info.value)
    assert "... and 74 more" in text  # 80 inputs, 6 shown
    assert len(text.splitlines()) < 20 and len(text) < 2000


def test_integer_tensors_are_not_checked_and_listed_only_on_request() -> None:
    with find_nonfinite() as scan:
        i = torch.arange(10)
        j = (i * 3 + 7) % 5
        torch.bincount(j)
    assert scan.ops_checked == 0  # integer outputs cannot be non-finite: no check at all
    x, zero = torch.ones(3), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(NonFiniteError) as info:
        with find_nonfinite():
            x / zero
    assert "int64" not in str(info.value)
    with pytest.raises(NonFiniteError) as info:
        with find_nonfinite(skip_ints=False):
            x / zero
    assert "[1] (3,) int64 cpu: min 0 max 0 zeros 3" in str(info.value)


# -- results and lifetime ----------------------------------------------------------------

@pytest.mark.parametrize("factory", [TinyResNet, _tiny_transformer], ids=["resnet", "transformer"])
def test_results_are_bitwise_identical(factory, device: torch.device) -> None:
    torch.manual_seed(0)
    model = factory().to(device)
    x = torch.randn(4, 3, 8, 8, device=device) if factory is TinyResNet else torch.randn(
        2, 5, 16, device=device)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def run():
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        out.square().mean().backward()
        return [out.detach().clone()] + [p.grad.clone() for p in model.parameters()] + [
            b.clone() for b in model.buffers()]

    bare = run()
    with find_nonfinite(model) as scan:
        watched = run()
    assert scan.ops_checked > 20
    assert len(bare) == len(watched)
    for a, b in zip(bare, watched):
        assert torch.equal(a, b)
    assert _no_hooks(model) and _no_mode()


def test_no_hooks_or_mode_left_after_exit_raise_and_model_error() -> None:
    model = PrePostNet()
    user = model.pre.register_forward_hook(lambda m, a, o: None)  # the user's own hook stays
    x = torch.randn(6, 3)
    with find_nonfinite(model):
        assert len(model.post[0]._forward_pre_hooks) == 1
        model(x)
    assert len(model.pre._forward_hooks) == 1 and _no_mode()
    with pytest.raises(NonFiniteError):
        with find_nonfinite(model):
            model(x).sum().backward()
    assert len(model.pre._forward_hooks) == 1 and _no_mode()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with find_nonfinite(model):
            model(torch.randn(6, 7))  # the model's own forward raises
    assert len(model.pre._forward_hooks) == 1 and _no_mode()
    user.remove()
    assert _no_hooks(model)


def test_reentry_and_nesting() -> None:
    model = PrePostNet()
    x = torch.randn(6, 3)
    for _ in range(3):  # a notebook cell run again and again
        with pytest.raises(NonFiniteError):
            with find_nonfinite(model):
                model(x).sum().backward()
        assert _no_hooks(model) and _no_mode()
    with find_nonfinite(model) as outer:
        with pytest.raises(NonFiniteError) as info:
            with find_nonfinite(model):
                model(x).sum().backward()
        assert info.value.anomaly.module == "culprit"
        assert torch._C._len_torch_dispatch_stack() == 1  # only the outer mode is left
        with pytest.raises(NonFiniteError, match=r"forward op aten\.exp"):
            torch.exp(torch.tensor(1e4))  # the outer context still checks
    assert outer.ops_checked > 0
    assert _no_hooks(model) and _no_mode()


def test_keeps_no_tensor_past_the_context() -> None:
    model = PrePostNet()
    with find_nonfinite(model, check_backward=False):
        out = model(torch.randn(6, 3))
        ref = weakref.ref(out)
        grad_fn_name = out.grad_fn.name()
    del out
    gc.collect()
    assert ref() is None
    assert grad_fn_name == "AddmmBackward0"


def test_error_is_a_gradient_anomaly_error_with_an_anomaly() -> None:
    from graddbg.anomaly import Anomaly

    with pytest.raises(GradientAnomalyError) as info:
        with find_nonfinite():
            torch.tensor([0.0]) / torch.tensor([0.0])
    assert isinstance(info.value, NonFiniteError)
    assert isinstance(info.value.anomaly, Anomaly)
    assert info.value.anomaly.message == str(info.value)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match=r"find_nonfinite\(model=...\): got str, expected a torch.nn.Module or None"):
        with find_nonfinite("model"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="check_forward and check_backward are both False"):
        with find_nonfinite(check_forward=False, check_backward=False):
            pass
    with pytest.raises(TypeError, match=r"find_nonfinite\(skip_ints=...\): got 1; accepted: True or False"):
        with find_nonfinite(skip_ints=1):  # type: ignore[arg-type]
            pass
    assert _no_mode()


def test_cross_entropy_training_step_is_clean() -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    with find_nonfinite(model) as scan:
        for _ in range(3):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert scan.ops_checked > 30
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _BadRecip(torch.autograd.Function):
    """A custom Function whose backward divides by the input: 1/0 at x = 0."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * x / x  # 0 / 0 at x = 0 (the true derivative is 2x)


class UsesCustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BadRecip.apply(torch.relu(self.fc(x)))


def test_custom_function_backward_is_named_with_its_module() -> None:
    model = nn.Sequential(nn.Linear(3, 3), UsesCustomFunction())
    with pytest.raises(NonFiniteError, match="backward op _BadRecipBackward") as info:
        with find_nonfinite(model):
            model(torch.randn(16, 3)).sum().backward()
    a = info.value.anomaly
    assert a.op == "_BadRecipBackward"
    assert a.module == "1"
    # the forward code of the Function: the op whose output became the node's output
    assert a.source == f"{HERE}:{inspect.getsourcelines(_BadRecip.forward)[1] + 3}"


def test_attention_masks_built_from_minus_inf_are_not_reported() -> None:
    q = torch.randn(2, 5, 8, requires_grad=True)
    with find_nonfinite() as scan:
        mask = nn.Transformer.generate_square_subsequent_mask(5)  # -inf above the diagonal
        scores = q @ q.transpose(1, 2) / 8 ** 0.5
        attn = torch.softmax(scores + mask, dim=-1)
        filled = torch.softmax(scores.masked_fill(mask.bool(), float("-inf")), dim=-1)
        (attn.sum() + filled.sum()).backward()
    assert torch.allclose(attn, filled)
    assert torch.isfinite(q.grad).all()
    assert scan.ops_checked > 5


def test_dataparallel_wrapper_is_named_through() -> None:
    inner = NormNet()
    with torch.no_grad():
        inner.embed.bias.fill_(-100.0)
    wrapped = nn.DataParallel(inner)  # on CPU it just calls the module
    with pytest.raises(NonFiniteError, match=r"module: norm \(RowNormalise\)") as info:
        with find_nonfinite(wrapped):
            wrapped(torch.randn(3, 4))
    assert info.value.anomaly.module == "norm"
    assert info.value.anomaly.rank is None  # no process group
    assert _no_hooks(wrapped)


def test_gradient_accumulation_overflow_names_the_parameter() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with torch.no_grad():  # hidden = (1, 1), output = 0.5: every forward value is finite
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)
        model[1].weight.fill_(0.25)
        model[1].bias.zero_()
    model[1].weight.grad = torch.full_like(model[1].weight, 3e38)  # accumulated so far
    with pytest.raises(NonFiniteError, match="parameter: 1.weight") as info:
        with find_nonfinite(model):
            (model(torch.ones(1, 2)) * 3e38).sum().backward()  # finite, but the sum is not
    a = info.value.anomaly
    assert (a.op, a.name, a.module) == ("torch::autograd::AccumulateGrad", "1.weight", "1")


class ConstLayer(nn.Module):
    def __init__(self, inject: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.inject = inject

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if self.inject:
            ConstLayer.line = _line() + 1
            h = h * torch.where(torch.arange(6) == 0, torch.tensor(float("nan")), torch.tensor(1.0))
        return h


@pytest.mark.parametrize("k", [1, 3])
def test_nan_constant_injected_in_layer_k_is_blamed_where_it_was_written(k: int) -> None:
    model = nn.ModuleDict({"layers": nn.Sequential(*[ConstLayer(i == k) for i in range(5)])})
    with pytest.raises(NonFiniteError, match="NaN produced from a NaN constant") as info:
        with find_nonfinite(model):
            model["layers"](torch.randn(4, 6)).sum().backward()
    a = info.value.anomaly
    assert (a.module, a.op) == (f"layers.{k}", "aten.lift_fresh")
    assert a.source == f"{HERE}:{ConstLayer.line}"
    assert "try: a NaN constant" in str(info.value)


def test_nan_fill_value_is_blamed_but_inf_fill_value_is_not() -> None:
    x = torch.randn(3)
    with find_nonfinite():
        torch.full((2, 2), float("-inf"))
        x.masked_fill(x > 0, float("inf"))
        torch.tensor([1.0, float("-inf")])
    with pytest.raises(NonFiniteError, match=r"from a NaN constant by forward op aten\.fill_"):
        with find_nonfinite():
            torch.zeros(3).fill_(float("nan"))


def test_scripted_submodule_is_left_alone() -> None:
    class Log(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is deprecated in recent torch
        scripted = torch.jit.script(Log())
    model = nn.Sequential(nn.Linear(2, 2), nn.Softplus(), scripted)
    x = torch.randn(3, 2)
    with find_nonfinite(model) as scan:
        out = model(x)
    assert torch.equal(out, model(x))
    assert scan.ops_checked >= 3
    assert _no_hooks(model)
