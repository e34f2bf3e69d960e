"""pytorch/examples reinforcement_learning/actor_critic.py in small: one Policy with an
action head and a value head, Adam(lr=3e-2), discounted normalised returns, policy loss
-log_prob * advantage plus smooth-L1 value loss, optimizer.zero_grad() / backward / step
once per episode. A tiny synthetic environment (a pole angle that the action pushes left
or right; done when it falls or after 30 steps) instead of gym's CartPole."""
import torch
from torch import nn
from torch.distributions import Categorical
from torch.nn import functional as F

torch.manual_seed(0)
torch.set_num_threads(1)
GAMMA = 0.99
EPS = torch.finfo(torch.float32).eps


class PoleEnv:
    """state: (x, x_dot, theta, theta_dot); reward 1 per step while |theta| < 0.4."""

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
        self.action_head = nn.Linear(32, 2)
        self.value_head = nn.Linear(32, 1)
        self.saved_actions = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.affine1(x))
        return F.softmax(self.action_head(x), dim=-1), self.value_head(x)


model = Policy()
optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
env = PoleEnv()


def select_action(state):
    probs, state_value = model(state)
    m = Categorical(probs)
    action = m.sample()
    model.saved_actions.append((m.log_prob(action), state_value))
    return action.item()


def finish_episode():
    R, returns = 0.0, []
    for r in model.rewards[::-1]:
        R = r + GAMMA * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + EPS)
    policy_losses, value_losses = [], []
    for (log_prob, value), R in zip(model.saved_actions, returns):
        advantage = R - value.item()
        policy_losses.append(-log_prob * advantage)
        value_losses.append(F.smooth_l1_loss(value, torch.tensor([R])))
    optimizer.zero_grad()
    loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
    loss.backward()
    optimizer.step()
    del model.rewards[:]
    del model.saved_actions[:]
    return loss


for i_episode in range(12):
    state, done = env.reset(), False
    while not done:
        action = select_action(state)
        state, reward, done = env.step(action)
        model.rewards.append(reward)
    loss = finish_episode()
    print(f"loss {i_episode} {loss.item():.8e}")
