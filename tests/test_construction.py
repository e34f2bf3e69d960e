"""module_setup: a module whose construction does not do what it says (graddbg/checks/construction.py)."""
import warnings

import pytest
import torch
from torch import nn

import graddbg


class _Net(nn.Module):
    def __init__(self, heads=None):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(10, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.heads = heads

    def forward(self, x):
        h = self.head(self.backbone(x))
        if self.heads is None:
            return h
        parts = self.heads.values() if isinstance(self.heads, nn.ModuleDict) else self.heads
        return torch.cat([m(h) for m in parts], 1)


def _train(model, steps=4, change=None, **kw):
    torch.manual_seed(1)
    x = torch.randn(32, 10)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, **kw) as w:
            for i in range(steps):
                if change is not None:
                    change(model, i)
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
    return [a for a in w.anomalies if a.kind == "module_setup"], w


def test_a_requires_grad_attribute_on_a_module_that_freezes_nothing_is_named():
    torch.manual_seed(0)
    model = _Net()
    model.backbone.requires_grad = False
    found, _ = _train(model)
    assert len(found) == 1 and found[0].step == 0 and found[0].severity == "bug"
    assert found[0].params == ("backbone.0.weight", "backbone.0.bias") and found[0].module == "backbone"
    msg = found[0].message
    assert "model.backbone.requires_grad = False sets an attribute of the Sequential and changes nothing" in msg
    assert "the optimizer holds them, so it trains them" in msg and "requires_grad_(False)" in msg, msg


def test_a_requires_grad_attribute_that_unfreezes_nothing_is_named_when_it_is_set():
    torch.manual_seed(0)
    model = _Net()
    model.backbone.requires_grad_(False)

    def unfreeze(m, i):
        if i == 2:
            m.backbone.requires_grad = True  # (meant: unfreeze the backbone from step 2 on)

    found, _ = _train(model, steps=12, change=unfreeze)
    assert len(found) == 1 and found[0].step == 2  # (step 2 is one of the audit's steps)
    assert "still frozen (requires_grad=False), so nothing was unfrozen" in found[0].message
    assert found[0].params == ("backbone.0.weight", "backbone.0.bias")  # (frozen: named from the model)


@pytest.mark.parametrize("container", [
    lambda: nn.ModuleList([nn.Linear(4, 1)] * 3),
    lambda: nn.Sequential(*[nn.Linear(4, 4)] * 2, nn.Linear(4, 1)),
    lambda: nn.ModuleDict(dict.fromkeys("abc", nn.Linear(4, 1))),
], ids=["ModuleList", "Sequential", "ModuleDict"])
def test_one_module_object_at_several_places_of_a_container_is_a_fact(container):
    torch.manual_seed(0)
    heads = container()
    model = _Net(heads if not isinstance(heads, nn.Sequential) else nn.ModuleList([heads]))
    found, w = _train(model, module_setup="raise")  # (a fact is warned, never raised)
    assert len(found) == 1 and found[0].severity == "fact" and found[0].step == 0
    msg = found[0].message
    assert "a fact, maybe a bug" in msg and "holds one Linear object at" in msg and "[module] * n" in msg, msg
    assert found[0].params and all(n.startswith("heads.") for n in found[0].params)
    assert w.current_step == 4


def _shared_activation():
    act = nn.ReLU()  # (one activation object in both heads: no parameters, nothing shared that trains)
    return nn.ModuleList([nn.Sequential(nn.Linear(4, 1), act), nn.Sequential(nn.Linear(4, 1), act)])


@pytest.mark.parametrize("setup", [
    lambda m: m.backbone.requires_grad_(False),                                  # the method
    lambda m: (m.backbone.requires_grad_(False), setattr(m.backbone, "requires_grad", False)),  # both agree
    lambda m: setattr(m, "heads", nn.ModuleList([nn.Linear(4, 1) for _ in range(3)])),  # distinct heads
    lambda m: setattr(m, "heads", _shared_activation()),
    lambda m: setattr(m.backbone, "extra", nn.Sequential(*[nn.ReLU()] * 3)),   # a parameterless module reused
], ids=["requires_grad_", "attribute and method agree", "distinct heads", "shared activation", "reused ReLU"])
def test_modules_that_do_what_they_say_are_silent(setup):
    torch.manual_seed(0)
    model = _Net()
    setup(model)
    found, w = _train(model)
    assert found == [] and not [a for a in w.anomalies if a.severity == "bug"], [a.message for a in w.anomalies]


def test_module_setup_none_turns_it_off():
    torch.manual_seed(0)
    model = _Net(nn.ModuleList([nn.Linear(4, 1)] * 2))
    model.backbone.requires_grad = False
    found, _ = _train(model, module_setup=None)
    assert found == []


def test_what_was_reported_survives_a_checkpoint_of_the_watch():
    from graddbg.checks.construction import ModuleSetup
    from graddbg.checks.base import _from_json, _to_json
    import json
    check = ModuleSetup()
    check._seen = {"flag:backbone", "repeated:heads.0"}
    state = json.loads(json.dumps(check.state_dict()))
    again = ModuleSetup()
    again._seen = set()
    again.load_state_dict(state)
    assert again._seen == {"flag:backbone", "repeated:heads.0"}
    assert _from_json(_to_json(again._seen)) == again._seen
