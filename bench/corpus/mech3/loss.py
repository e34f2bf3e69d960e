"""The third corpus, mechanism 'loss' (reduction, weighting, targets, masks, terms that cancel or
vanish): cases mined from public reports by worker c."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    classification,
    linear_regression,
    mlp,
    trains,
)
from .._m3_c import (
    binary_data,
    recall,
    tanh_reg,
)


# --- inverse-frequency class weights given in the wrong order
def _cw_build(seed):
    model = mlp(seed, d_out=2)
    x, y = binary_data(seed, pos_rate=0.12)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y}


def _cw_loop(reversed_order: bool):
    def loop(model, opt, ex, steps):
        # class frequencies of the training labels: class 0 is the frequent one
        freq = torch.bincount(ex["y"], minlength=2).float() / len(ex["y"])
        if reversed_order:
            weights = torch.tensor([1 / freq[1], 1 / freq[0]])
        else:
            weights = torch.tensor([1 / freq[0], 1 / freq[1]])
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y, weight=weights)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            pred = model(ex["x"]).argmax(1)
        return {"losses": losses, "recall1": recall(pred, ex["y"], 1)}
    return loop


CLASS_WEIGHTS_REVERSED = Case(
    name="class_weights_in_reversed_order",
    family="loss",
    source="amanshenoy/multilogue-net issue #21 ('Possible error in loss weight assignment': "
           "loss_weights = torch.FloatTensor([1/0.0816, 1/0.9184]) gives label 0, the frequent "
           "one, the large weight; maintainer: 'Flipping them should be the right way to go')",
    description="I weight CrossEntropyLoss by inverse class frequency for my imbalanced data, "
                "yet the rare class is recalled even worse than without weights.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["recall1"] <= f["recall1"] - 0.3 and f["recall1"] >= 0.7,
    build_buggy=_cw_build, loop_buggy=_cw_loop(True),
    build_fixed=_cw_build, loop_fixed=_cw_loop(False),
    steps=60,
)


# --- the infill loss averaged over the context frames instead of the masked ones
def _infill_data(seed, n=512, d=8):
    """Frames with a mask flag (True: the frame to infill, ~30%); the two kinds of frame follow
    different teachers, so learning one says little about the other."""
    gen = torch.Generator().manual_seed(seed + 5000)
    feats = torch.randn(n, d, generator=gen)
    mask = torch.rand(n, generator=gen) < 0.3
    wa = torch.randn(d, 1, generator=gen) / d ** 0.5
    wb = torch.randn(d, 1, generator=gen) / d ** 0.5
    y = torch.where(mask[:, None], torch.sin(2 * feats @ wa), feats @ wb)
    x = torch.cat([feats, mask[:, None].float()], 1)
    return x, y, mask


def _infill_build(seed):
    model = tanh_reg(seed, d_in=9)
    x, y, mask = _infill_data(seed)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y, "m": mask}


def _infill_loop(fill_where_masked: bool):
    def loop(model, opt, ex, steps):
        losses = []
        n = ex["x"].shape[0]
        for i in range(steps):
            idx = torch.arange(i * 64, i * 64 + 64) % n
            x, y, mask = ex["x"][idx], ex["y"][idx], ex["m"][idx]
            opt.zero_grad()
            loss = F.mse_loss(model(x), y, reduction="none").squeeze(1)
            if fill_where_masked:
                loss = loss.masked_fill(mask, 0.0)   # zeroes the frames to infill
            else:
                loss = loss.masked_fill(~mask, 0.0)  # keeps only the frames to infill
            loss = loss.sum() / mask.sum().clamp(min=1)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            m = ex["m"]
            infill = F.mse_loss(model(ex["x"][m]), ex["y"][m]).item()
        return {"losses": losses, "infill_mse": infill}
    return loop


INFILL_MASK_INVERTED = Case(
    name="infill_loss_mask_inverted",
    family="loss",
    source="lucidrains/voicebox-pytorch issue #6 ('There might be a bug in the loss "
           "calculation': loss.masked_fill(mask, 0.) zeroes the masked part the paper averages "
           "over, while the denominator still counts mask.sum(); fixed by the maintainer)",
    description="My infilling model's loss goes down nicely, but the frames it is supposed to "
                "fill in come out no better than at the start.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["infill_mse"] >= 3.0 * f["infill_mse"] and trains(f, 0.3),
    build_buggy=_infill_build, loop_buggy=_infill_loop(True),
    build_fixed=_infill_build, loop_fixed=_infill_loop(False),
    steps=60,
)


# --- binary label smoothing written as target.add_(eps).div_(2)
def _ls_build(seed):
    model = mlp(seed, d_out=1)
    x, y = binary_data(seed, pos_rate=0.5)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y.float()[:, None]}


def _smooth(target, eps, buggy):
    target = target.float()
    if buggy:
        return target.add_(eps).div_(2.0)
    return target * (1 - eps) + eps / 2


def _ls_loop(buggy: bool, eps: float = 0.1):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i, 64)
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(x), _smooth(y, eps, buggy))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            p = torch.sigmoid(model(ex["x"]))
        pos = ex["y"] > 0.5
        return {"losses": losses, "pos_prob": p[pos].mean().item(),
                "pos_recall": (p[pos] > 0.5).float().mean().item()}
    return loop


BCE_SMOOTHING_HALVED = Case(
    name="bce_label_smoothing_halves_positive_target",
    family="loss",
    source="eladhoffer/utils.pytorch issue #13 ('Possible Bug in LabelSmoothing for Binary Cross "
           "Entropy': target.add_(smooth_eps).div_(2.) instead of target * (1 - smooth_eps) + "
           "smooth_eps / 2)",
    description="With label smoothing 0.1 in my binary cross-entropy, my classifier's "
                "probabilities for the positive class hover just above 0.5 and many positives "
                "fall below the threshold.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (b["pos_prob"] <= 0.65 and f["pos_prob"] >= 0.8
                           and b["pos_recall"] <= f["pos_recall"] - 0.1),
    build_buggy=_ls_build, loop_buggy=_ls_loop(True),
    build_fixed=_ls_build, loop_fixed=_ls_loop(False),
    steps=60,
)


# --- REINFORCE: the mean log-probability of the episode times every return
def _pg_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    gen = torch.Generator().manual_seed(seed + 6000)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y, "g": gen}


def _pg_loop(mean_first: bool, gamma: float = 0.0):
    def loop(model, opt, ex, steps):
        losses, rewards_seen = [], []
        for i in range(steps):
            # one episode: 32 independent contexts, reward 1 for the teacher's action
            x, y = batch(ex["x"], ex["y"], i)
            probs = F.softmax(model(x), 1)
            actions = torch.multinomial(probs.detach(), 1, generator=ex["g"]).squeeze(1)
            log_probs = torch.log(probs.gather(1, actions[:, None]).squeeze(1))
            rewards = (actions == y).float().tolist()
            running_g, gs = 0.0, []
            for r in rewards[::-1]:
                running_g = r + gamma * running_g
                gs.insert(0, running_g)
            deltas = torch.tensor(gs)
            if mean_first:
                log_prob_mean = log_probs.mean()
                loss = -torch.sum(log_prob_mean * deltas)
            else:
                loss = -torch.sum(log_probs * deltas)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            rewards_seen.append(sum(rewards) / len(rewards))
        with torch.no_grad():
            p = F.softmax(model(ex["x"]), 1)
        expected = p.gather(1, ex["y"][:, None]).mean().item()
        return {"losses": losses, "rewards": rewards_seen, "expected_reward": expected}
    return loop


REINFORCE_MEAN_LOGPROB = Case(
    name="reinforce_mean_log_prob_times_returns",
    family="loss",
    source="Farama-Foundation/Gymnasium issue #1336 ('Bad REINFORCE implementation for Mujoco "
           "Tutorial': log_prob_mean = log_probs.mean(); loss = -torch.sum(log_prob_mean * "
           "deltas), instead of each log-probability times its own return)",
    description="My REINFORCE agent's reward does not improve: following the tutorial, my loss "
                "multiplies the mean log-probability of the episode by the returns.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (f["expected_reward"] >= 0.6
                           and b["expected_reward"] <= f["expected_reward"] - 0.25),
    build_buggy=_pg_build, loop_buggy=_pg_loop(True),
    build_fixed=_pg_build, loop_fixed=_pg_loop(False),
    steps=60,
)


# --- a padded loss averaged over every position, padding included
def _pad_data(seed, T=8):
    """Sequences of T frames, with 1 to 3 real frames each (the rest padding: zeros)."""
    x, y = linear_regression(seed, n=64 * T)
    gen = torch.Generator().manual_seed(seed + 7000)
    n_seq = x.shape[0] // T
    lengths = torch.randint(1, 4, (n_seq,), generator=gen)
    valid = torch.arange(T)[None, :] < lengths[:, None]
    x = x.view(n_seq, T, -1) * valid[..., None]
    y = y.view(n_seq, T, 1) * valid[..., None]
    return x, y, valid


def _padm_build(seed):
    torch.manual_seed(seed)
    model = nn.Linear(8, 1)
    x, y, valid = _pad_data(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.05), {"x": x, "y": y, "v": valid}


def _padm_loop(mean_over_all: bool):
    def loop(model, opt, ex, steps):
        losses = []
        n = ex["x"].shape[0]
        for i in range(steps):
            idx = torch.arange(i * 8, i * 8 + 8) % n
            x, y, valid = ex["x"][idx], ex["y"][idx], ex["v"][idx].float()
            opt.zero_grad()
            per_frame = F.mse_loss(model(x), y, reduction="none").squeeze(-1)
            if mean_over_all:
                loss = torch.mean(per_frame * valid)
            else:
                loss = torch.sum(per_frame * valid) / torch.sum(valid)
            loss.backward()
            opt.step()
            with torch.no_grad():
                losses.append((torch.sum(per_frame * valid) / torch.sum(valid)).item())
        v = ex["v"]
        with torch.no_grad():
            real = F.mse_loss(model(ex["x"][v]), ex["y"][v]).item()
        return {"losses": losses, "real_mse": real}
    return loop


PADDED_MEAN = Case(
    name="masked_loss_mean_counts_padding",
    family="loss",
    source="DeepX-inc/machina pull request #198 ('torch.mean(loss * out_masks) should be "
           "replaced by torch.sum(loss * out_masks) / torch.sum(out_masks)'); uncbiag/ICON pull "
           "request #83 review ('otherwise the loss is dominated by locations zeroed out by the "
           "masks'); d2l-ai/d2l-en issue #2076 (MaskedSoftmaxCELoss '.mean(dim=1)' counts the "
           "padding in the denominator)",
    description="I mask the padded frames out of my sequence loss and take the mean; the model "
                "trains several times slower than on unpadded data with the same learning rate.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["real_mse"] >= 2.0 * f["real_mse"] and trains(f, 0.5),
    build_buggy=_padm_build, loop_buggy=_padm_loop(True),
    build_fixed=_padm_build, loop_fixed=_padm_loop(False),
    steps=30,
)


CASES = [CLASS_WEIGHTS_REVERSED, INFILL_MASK_INVERTED, BCE_SMOOTHING_HALVED,
         REINFORCE_MEAN_LOGPROB, PADDED_MEAN]
