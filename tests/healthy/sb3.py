"""stable-baselines3 as its users run it: PPO and DQN on CartPole-v1 with the RL Zoo's
hyperparameters, SAC on Pendulum-v1 with the Zoo's learning rate, each for a few hundred to
a couple of thousand timesteps, the library's code unchanged.

- PPO: 8 vectorised environments, 8 rollouts of 32 steps, 20 epochs (one minibatch of 256)
  per rollout: 160 Adam steps with clip_grad_norm_(0.5). The Zoo's linear schedules of the
  learning rate and the clip range are written into the param groups before each round and
  reach 0 for the last round (SB3 trains after the last rollout with progress_remaining =
  0): its 20 steps are made at lr 0, as in every run of the Zoo's `lin_` schedules.
- DQN: 1280 environment steps, a replay buffer, 128 Adam steps with clip_grad_norm_(10) every
  256 environment steps once 250 were collected (5 rounds, 640 steps), and the hard copy
  (polyak_update with tau 1, through `.data`) of the Q-network into its target network
  every 10 environment steps: 128 copies, 25 or 26 between two rounds, so each round after
  the first trains against a target that changed since the previous one.
- SAC: 400 environment steps, one gradient step per step after 100: three Adam optimizers
  (critic, actor, entropy coefficient) stepped one after the other, then the Polyak average
  (tau 0.005) of the critic into its target; 300 steps.

SB3 prints no per-step loss: a callback reads the loss each ``train()`` recorded into the
model's logger (``train/loss``; SAC: ``train/critic_loss`` and ``train/actor_loss``) when
the next rollout starts and when training ends, one line per training round, and each
model's parameters are summed at the end (a line each), so equal lines mean the watched
and unwatched runs trained the same networks bit for bit."""
import torch
from stable_baselines3 import DQN, PPO, SAC
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.utils import LinearSchedule

torch.set_num_threads(1)
lines = []


def emit(value):
    print(f"loss {len(lines)} {value:.8e}")
    lines.append(value)


class PrintLosses(BaseCallback):
    """One line per key for each training round (read when the next rollout starts: SB3
    records the losses at the end of train() and dumps them during the next rollout)."""

    def __init__(self, keys):
        super().__init__()
        self.keys, self.seen = keys, 0

    def _read(self):
        values = self.model.logger.name_to_value
        if values.get("train/n_updates", 0) > self.seen:
            self.seen = values["train/n_updates"]
            for key in self.keys:
                emit(values[key])

    def _on_rollout_start(self):
        self._read()

    def _on_training_end(self):
        self._read()

    def _on_step(self):
        return True


def finish(model):
    emit(sum(p.detach().double().sum().item() for p in model.policy.parameters()))


# rl-zoo hyperparams/ppo.yml, CartPole-v1 (n_timesteps 1e5 there)
ppo = PPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=8, seed=0), n_steps=32, batch_size=256,
          gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0, learning_rate=LinearSchedule(1e-3, 0.0, 1.0),
          clip_range=LinearSchedule(0.2, 0.0, 1.0), seed=0, device="cpu")
ppo.set_logger(Logger(folder=None, output_formats=[]))  # (SB3's default logger makes a folder in /tmp)
ppo.learn(total_timesteps=2048, callback=PrintLosses(["train/loss"]))
finish(ppo)

# rl-zoo hyperparams/dqn.yml, CartPole-v1 (n_timesteps 5e4 and learning_starts 1000 there)
dqn = DQN("MlpPolicy", "CartPole-v1", learning_rate=2.3e-3, batch_size=64, buffer_size=100000,
          learning_starts=250, gamma=0.99, target_update_interval=10, train_freq=256, gradient_steps=128,
          exploration_fraction=0.16, exploration_final_eps=0.04, policy_kwargs=dict(net_arch=[256, 256]),
          seed=0, device="cpu")
dqn.set_logger(Logger(folder=None, output_formats=[]))  # (SB3's default logger makes a folder in /tmp)
dqn.learn(total_timesteps=1280, callback=PrintLosses(["train/loss"]))
finish(dqn)

# rl-zoo hyperparams/sac.yml, Pendulum-v1 (n_timesteps 2e4 there)
sac = SAC("MlpPolicy", "Pendulum-v1", learning_rate=1e-3, learning_starts=100, seed=0, device="cpu")
sac.set_logger(Logger(folder=None, output_formats=[]))  # (SB3's default logger makes a folder in /tmp)
sac.learn(total_timesteps=400, callback=PrintLosses(["train/critic_loss", "train/actor_loss"]))
finish(sac)
