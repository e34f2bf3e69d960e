"""The third corpus, mechanism 'params' (bench/corpus/mechanisms.py: the model's parameters
and their initial state: init, freezing, tying, buffers, copies), mined by worker b."""
from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    MLP,
    Case,
    changed,
    classification,
    mlp,
    snapshot,
    trains,
)
from .._m3_b import (
    backbone,
    ce_steps,
    full_ce,
)


# ---- target_network_aliases_policy_network


class QNet(nn.Module):
    def __init__(self, n_states=8, n_actions=4, hidden=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_states, hidden), nn.ReLU(),
                                 nn.Linear(hidden, n_actions))

    def forward(self, s):
        return self.net(s)


def _mdp(seed, n=64, d=8, actions=4):
    gen = torch.Generator().manual_seed(seed + 4000)
    phi = torch.randn(n, d, generator=gen)
    nxt = torch.randint(0, n, (n, actions), generator=gen)
    rew = torch.rand(n, actions, generator=gen) * 2 - 1
    s = torch.randint(0, n, (4096,), generator=gen)
    a = torch.randint(0, actions, (4096,), generator=gen)
    return {"phi": phi, "next": nxt, "rew": rew, "s": s, "a": a}


def _q_star(ex, gamma, iters=300):
    """The optimal action values, by value iteration on the known MDP."""
    q = torch.zeros_like(ex["rew"])
    for _ in range(iters):
        q = ex["rew"] + gamma * q.max(1)[0][ex["next"]]
    return q


def _q_build(alias):
    def build(seed):
        torch.manual_seed(seed)
        model = QNet()
        policy_net = model
        if alias:
            target_net = model  # the same object under a second name
        else:
            target_net = QNet()
        target_net.load_state_dict(policy_net.state_dict())
        opt = torch.optim.Adam(policy_net.parameters(), lr=0.03)
        ex = _mdp(seed)
        ex["target_net"] = target_net
        return policy_net, opt, ex
    return build


def _q_loop(model, opt, ex, steps, gamma=0.9, sync=10, size=32):
    target_net, phi = ex["target_net"], ex["phi"]
    probe = phi[:16]
    losses, drift = [], 0.0
    q_star = _q_star(ex, gamma)
    with torch.no_grad():
        frozen = target_net(probe).clone()
        err0 = (model(phi) - q_star).abs().mean().item()
    for i in range(steps):
        idx = torch.arange(i * size, (i + 1) * size)
        s, a = ex["s"][idx], ex["a"][idx]
        q = model(phi[s]).gather(1, a[:, None]).squeeze(1)
        with torch.no_grad():
            q_next = target_net(phi[ex["next"][s, a]]).max(1)[0]
        target = ex["rew"][s, a] + gamma * q_next
        loss = F.smooth_l1_loss(q, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        with torch.no_grad():  # the target net must not move between two syncs
            drift = max(drift, (target_net(probe) - frozen).abs().max().item())
        if (i + 1) % sync == 0:
            target_net.load_state_dict(model.state_dict())
            with torch.no_grad():
                frozen = target_net(probe).clone()
    with torch.no_grad():
        err = (model(phi) - q_star).abs().mean().item()
    return {"losses": losses, "target_drift": drift, "q_err0": err0, "q_err": err}


TARGET_NETWORK_ALIASES_POLICY_NETWORK = Case(
    name="target_network_aliases_policy_network",
    family="params",
    source="datawhalechina/easy-rl issue #140 (self.policy_net = model.to(device) and "
           "self.target_net = model.to(device); translated: 'two policy_net and target_net "
           "objects with the same memory address'; the same in DDPG's critic/target_critic); andri27-ts/Reinforcement-Learning issue #14 "
           "('Wouldn't this make the target network track the moving network in every "
           "update and make it ineffective?')",
    description="My DQN builds the policy and the target network from the same model object "
                "and copies the weights every 10 steps; the target values move with every "
                "update as if there were no target network.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (f["target_drift"] == 0.0 and b["target_drift"] >= 0.1
                           and f["q_err"] <= 0.85 * f["q_err0"]),
    build_buggy=_q_build(True),
    loop_buggy=_q_loop,
    build_fixed=_q_build(False),
    loop_fixed=_q_loop,
    steps=80,
)


# ---- freeze_undone_by_param_group_loop


class ConvLike(nn.Module):
    """A pretrained feature extractor (fc + bn) and a new head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(OrderedDict(
            fc=nn.Linear(10, 32), bn=nn.BatchNorm1d(32), act=nn.ReLU()))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def _yolo_build(bug):
    def build(seed):
        torch.manual_seed(seed)
        model = ConvLike()
        x, y = classification(seed)
        freeze = ["backbone."]  # parameter names to freeze (transfer learning)
        for k, v in model.named_parameters():
            if any(x in k for x in freeze):
                v.requires_grad = False
        pg0, pg1, pg2 = [], [], []  # optimizer parameter groups
        for k, v in model.named_parameters():
            if bug:
                v.requires_grad = True
            if ".bias" in k:
                pg2.append(v)  # biases
            elif ".weight" in k and ".bn" not in k:
                pg1.append(v)  # apply weight decay
            else:
                pg0.append(v)  # all else
        opt = torch.optim.SGD(pg0, lr=0.1, momentum=0.9, nesterov=True)
        opt.add_param_group({"params": pg1, "weight_decay": 5e-4})
        opt.add_param_group({"params": pg2})
        return model, opt, {"x": x, "y": y, "frozen": snapshot(model.backbone.parameters())}
    return build


def _yolo_loop(model, opt, ex, steps):
    losses = ce_steps(model, opt, ex["x"], ex["y"], steps)
    return {"losses": losses, "backbone_moved": changed(ex["frozen"], model.backbone.parameters())}


FREEZE_UNDONE_BY_PARAM_GROUP_LOOP = Case(
    name="freeze_undone_by_param_group_loop",
    family="params",
    source="ultralytics/yolov5 issue #1213 ('parameters freeze invalid': 'we set freeze "
           "parameters with requires_grad=False, However, in the following line, all "
           "paremters have been set as requires_grad=True, which overwrite the previous "
           "settings')",
    description="I freeze the pretrained backbone with requires_grad=False before building "
                "the optimizer's parameter groups, but the backbone weights still change "
                "during training.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["backbone_moved"] and not f["backbone_moved"] and trains(f, 0.3),
    build_buggy=_yolo_build(True),
    loop_buggy=_yolo_loop,
    build_fixed=_yolo_build(False),
    loop_fixed=_yolo_loop,
    steps=40,
)


# ---- batchnorm_momentum_tensorflow_convention


class BNNet(nn.Module):
    def __init__(self, momentum):
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.bn = nn.BatchNorm1d(32, momentum=momentum)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def _bn_build(momentum):
    def build(seed):
        torch.manual_seed(seed)
        model = BNNet(momentum)
        x, y = classification(seed, n=512)
        x = x * 3.0 + 2.0  # raw, unnormalised features
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        full0 = full_ce(model, x[:256], y[:256])  # train mode: the batch's own statistics
        return model, opt, {"x": x[:256], "y": y[:256], "xte": x[256:], "yte": y[256:],
                            "full0": full0}
    return build


def _bn_loop(model, opt, ex, steps, per_epoch=10):
    losses, evals = [], []
    for epoch in range(steps // per_epoch):
        model.train()
        losses += ce_steps(model, opt, ex["x"], ex["y"], per_epoch, start=epoch * per_epoch,
                           size=4)
        model.eval()  # validation after every epoch
        evals.append(full_ce(model, ex["xte"], ex["yte"]))
    with torch.no_grad():  # how far the running mean is from the training set's mean
        h = model.fc1(ex["x"])
        err = ((model.bn.running_mean - h.mean(0)).abs() / h.std(0)).mean().item()
    model.train()
    return {"losses": losses, "eval": sum(evals[2:]) / len(evals[2:]), "stat_err": err,
            "full0": ex["full0"], "full": full_ce(model, ex["x"], ex["y"])}


BATCHNORM_MOMENTUM_TENSORFLOW_CONVENTION = Case(
    name="batchnorm_momentum_tensorflow_convention",
    family="params",
    source="ludwig-ai/ludwig pull request #2100 ('tensorflow.keras Batch Norm momentum is "
           "parameterized as 1 - torch Batch Norm momentum': the TabNet default 0.95 becomes "
           "0.05); r9y9/tacotron_pytorch issue #19 (BatchNorm1d momentum=0.99 'following "
           "tensorflow's default parameters', 'the momentum in PyTorch is the opposite'); "
           "pytorch/examples issue #289",
    description="I ported my model from Keras and kept BatchNorm's momentum at 0.95; training "
                "looks fine but in eval mode the model is much worse than in training.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (f["full"] <= 0.7 * f["full0"] and b["stat_err"] >= 2 * f["stat_err"]
                           and b["eval"] >= 1.1 * f["eval"]),
    build_buggy=_bn_build(0.95),
    loop_buggy=_bn_loop,
    build_fixed=_bn_build(0.05),
    loop_fixed=_bn_loop,
    steps=80,
)


# ---- model_and_optimizer_deepcopied_separately


def _copy_build(bug):
    def build(seed):
        base = mlp(seed)
        x, y = classification(seed)
        base_opt = torch.optim.Adam(base.parameters(), lr=0.01)
        ce_steps(base, base_opt, x, y, 10)  # a first, shared part of the training
        if bug:
            model = copy.deepcopy(base)
            opt = copy.deepcopy(base_opt)  # keeps Adam's moments, and its own parameters
        else:
            model, opt = copy.deepcopy((base, base_opt))  # one deepcopy keeps the link
        return model, opt, {"x": x, "y": y}
    return build


def _copy_loop(model, opt, ex, steps):
    before = snapshot(model.parameters())
    losses = ce_steps(model, opt, ex["x"], ex["y"], steps, start=10)
    return {"losses": losses, "moved": changed(before, model.parameters()),
            "full": full_ce(model, ex["x"], ex["y"])}


MODEL_AND_OPTIMIZER_DEEPCOPIED_SEPARATELY = Case(
    name="model_and_optimizer_deepcopied_separately",
    family="params",
    source="skorch-dev/skorch issue #317 ('module weights don't update after copy.deepcopy': "
           "the copied net's optimizer no longer references the copied module's parameters) "
           "and pull request #318 ('make sure copy links weights and optimizer')",
    description="I deep-copy my partly trained model and its optimizer to continue a variant "
                "of the run; the copy's weights never change when I train it.",
    expected_kinds=("orphan_param",),
    params=MLP,
    manifest=lambda b, f: not b["moved"] and f["moved"] and trains(f, 0.3),
    build_buggy=_copy_build(True),
    loop_buggy=_copy_loop,
    build_fixed=_copy_build(False),
    loop_fixed=_copy_loop,
    steps=40,
)


# ---- freeze_by_name_misses_dataparallel_prefix


def _dp_build(bug):
    def build(seed):
        model = nn.DataParallel(backbone(seed))
        x, y = classification(seed)
        freeze_mods = ["encoder."]
        if not bug and hasattr(model, "module"):
            freeze_mods = ["module." + m for m in freeze_mods]
        for name, p in model.named_parameters():
            if name.startswith(tuple(freeze_mods)):
                p.requires_grad = False
        opt = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()), lr=0.01)
        return model, opt, {"x": x, "y": y,
                            "frozen": snapshot(model.module.encoder.parameters())}
    return build


def _dp_loop(model, opt, ex, steps):
    losses = ce_steps(model, opt, ex["x"], ex["y"], steps)
    return {"losses": losses,
            "encoder_moved": changed(ex["frozen"], model.module.encoder.parameters())}


FREEZE_BY_NAME_MISSES_DATAPARALLEL_PREFIX = Case(
    name="freeze_by_name_misses_dataparallel_prefix",
    family="params",
    source="espnet/espnet pull request #1983 ('Fix freezing modules (when using multi-gpu)': "
           "'After we've wrapped model in nn.DataParallel, the name of the parameter is "
           "prepended with module.'); ecmwf/anemoi-core pull request #1159 ('no parameters "
           "are frozen, but still the logs say parameters successfully frozen')",
    description="I freeze the encoder by matching parameter names against --freeze-mods; "
                "since I wrap the model in DataParallel the encoder is trained anyway.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["encoder_moved"] and not f["encoder_moved"] and trains(f, 0.2),
    build_buggy=_dp_build(True),
    loop_buggy=_dp_loop,
    build_fixed=_dp_build(False),
    loop_fixed=_dp_loop,
    steps=40,
)


# ---- shared_trunk_listed_twice_in_optimizer


class Actor(nn.Module):
    def __init__(self, preprocess, n_actions=4):
        super().__init__()
        self.preprocess = preprocess
        self.last = nn.Linear(32, n_actions)

    def forward(self, s):
        return self.last(self.preprocess(s))


class Critic(nn.Module):
    def __init__(self, preprocess):
        super().__init__()
        self.preprocess = preprocess
        self.last = nn.Linear(32, 1)

    def forward(self, s):
        return self.last(self.preprocess(s))


SHARED = ("actor.preprocess.0.weight", "actor.preprocess.0.bias")


def _ac_build(bug):
    def build(seed):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(10, 32), nn.ReLU())  # shared by actor and critic
        actor, critic = Actor(net), Critic(net)
        model = nn.ModuleDict({"actor": actor, "critic": critic})
        if bug:
            opt = torch.optim.Adam(list(actor.parameters()) + list(critic.parameters()), lr=0.01)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=0.01)  # each parameter once
        x, y = classification(seed)
        gen = torch.Generator().manual_seed(seed + 6000)
        v = torch.sin(x @ torch.randn(10, 1, generator=gen) / 3)
        return model, opt, {"x": x, "y": y, "v": v}
    return build


def _ac_loop(model, opt, ex, steps):
    shared = model["actor"].preprocess[0].weight
    losses, first_move = [], None
    for i in range(steps):
        idx = torch.arange(i * 32, i * 32 + 32) % ex["x"].shape[0]
        s = ex["x"][idx]
        before = shared.detach().clone()
        loss = (F.cross_entropy(model["actor"](s), ex["y"][idx])
                + 0.5 * F.mse_loss(model["critic"](s), ex["v"][idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if first_move is None:
            first_move = (shared.detach() - before).norm().item()
        losses.append(loss.item())
    return {"losses": losses, "first_move": first_move}


SHARED_TRUNK_LISTED_TWICE_IN_OPTIMIZER = Case(
    name="shared_trunk_listed_twice_in_optimizer",
    family="params",
    source="thu-ml/tianshou issue #395 ('optimizer double update ?': Adam(list(actor.parameters()) "
           "+ list(critic.parameters())) with a preprocess net shared by actor and critic; 'the "
           "current version of the PPO test is updating some parameters twice'); "
           "pytorch/pytorch issue #40967 ('If the parameter appears twice within one parameter "
           "group ... That parameter will get updated *twice*')",
    description="My actor and critic share a preprocessing network and I build one Adam over "
                "actor.parameters() + critic.parameters(); the shared layers take two steps "
                "per batch.",
    expected_kinds=("update_rule", "double_step"),
    params=SHARED,
    manifest=lambda b, f: trains(f, 0.3) and b["first_move"] >= 1.8 * f["first_move"],
    build_buggy=_ac_build(True),
    loop_buggy=_ac_loop,
    build_fixed=_ac_build(False),
    loop_fixed=_ac_loop,
    steps=40,
)


CASES = [
    TARGET_NETWORK_ALIASES_POLICY_NETWORK,
    FREEZE_UNDONE_BY_PARAM_GROUP_LOOP,
    BATCHNORM_MOMENTUM_TENSORFLOW_CONVENTION,
    MODEL_AND_OPTIMIZER_DEEPCOPIED_SEPARATELY,
    FREEZE_BY_NAME_MISSES_DATAPARALLEL_PREFIX,
    SHARED_TRUNK_LISTED_TWICE_IN_OPTIMIZER,
]
