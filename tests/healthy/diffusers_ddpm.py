"""diffusers' DDPM training loop (examples/unconditional_image_generation/
train_unconditional.py, without accelerate) in small: a UNet2DModel with two resolution
levels, the second with attention, on random 16x16 RGB images; DDPMScheduler's 1000-step
linear beta schedule, a random timestep per image, add_noise, MSE between the predicted and
the true noise; AdamW (lr 1e-3 here, the example's 1e-4 being slow for 40 steps; its
betas, weight decay and eps), get_scheduler("cosine") of diffusers.optimization with
warm-up, clip_grad_norm_(1.0), zero_grad after the step, and the example's --use_ema:
diffusers.training_utils.EMAModel (warm-up decay, power 3/4) stepped after every
optimizer step into shadow tensors outside the model."""
import torch
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
STEPS, BATCH = 40, 8

model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                    block_out_channels=(16, 32), norm_num_groups=8,
                    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                    up_block_types=("AttnUpBlock2D", "UpBlock2D"))
noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8)
lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=5, num_training_steps=STEPS)
ema_model = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=3 / 4,
                     model_cls=UNet2DModel, model_config=model.config)
images = torch.rand(64, 3, 16, 16) * 2 - 1  # images scaled to [-1, 1], as the example's transforms do

model.train()
for step in range(STEPS):
    clean = images[torch.randint(0, len(images), (BATCH,))]
    noise = torch.randn(clean.shape)
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (BATCH,)).long()
    noisy = noise_scheduler.add_noise(clean, noise, timesteps)
    noise_pred = model(noisy, timesteps, return_dict=False)[0]
    loss = nn.functional.mse_loss(noise_pred.float(), noise.float())
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad()
    ema_model.step(model.parameters())
    print(f"loss {step} {loss.item():.8e}")
