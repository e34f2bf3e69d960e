"""pytorch/examples reinforcement_learning/reinforce.py in small: a Policy with dropout(0.6),
Adam(lr=1e-2), discounted normalised returns, loss = sum(-log_prob * R),
optimizer.zero_grad() / backward / step once per episode. A tiny synthetic environment (a
pole angle that the action pushes left or right) instead of gym's CartPole."""
import torch
from torch import nn
from torch.distributions import Categorical
from torch.nn import functional as F

torch.manual_seed(0)
torch.set_num_threads(1)
GAMMA = 0.99
EPS = torch.finfo(torch.float32).eps


class PoleEnv:
    def reset(self):
        self.s = (torch.rand(4) - 0.5) * 0.1
        self.t = 0
        return self.s.clone()

    def step(self, action):
        x, xd, th, thd = self.s.tolist()
        force = 1.0 if action == 1 else -1.0
        thd = thd + 0.05 * (9.8 * th - force)
        th = th + 0.05 * thd
        xd = xd + 0.05 * force
        x = x + 0.05 * xd
        self.s = torch.tensor([x, xd, th, thd])
        self.t += 1
        done = abs(th) > 0.4 or abs(x) > 2.4 or self.t >= 30
        return self.s.clone(), 1.0, done


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 32)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(32, 2)
        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=1)


policy = Policy()
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
env = PoleEnv()


def select_action(state):
    probs = policy(state.unsqueeze(0))
    m = Categorical(probs)
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return action.item()


def finish_episode():
    R, returns = 0.0, []
    for r in policy.rewards[::-1]:
        R = r + GAMMA * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + EPS)
    policy_loss = [-log_prob * R for log_prob, R in zip(policy.saved_log_probs, returns)]
    optimizer.zero_grad()
    policy_loss = torch.cat(policy_loss).sum()
    policy_loss.backward()
    optimizer.step()
    del policy.rewards[:]
    del policy.saved_log_probs[:]
    return policy_loss


for i_episode in range(12):
    state, done = env.reset(), False
    while not done:
        action = select_action(state)
        state, reward, done = env.step(action)
        policy.rewards.append(reward)
    loss = finish_episode()
    print(f"loss {i_episode} {loss.item():.8e}")
