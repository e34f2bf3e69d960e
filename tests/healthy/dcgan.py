"""pytorch/examples dcgan/main.py in small: two Adam optimizers (betas 0.5, 0.999), BCELoss,
netD.zero_grad() / two backward passes / optimizerD.step(), then netG.zero_grad() /
errG.backward() through netD / optimizerG.step(). Random 1x16x16 "images"."""
import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
nz, ngf, ndf, nc, batch = 8, 8, 8, 1, 8


def weights_init(m):
    name = type(m).__name__
    if name.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif name.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, x):
        return self.main(x)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1, 1).squeeze(1)


netG = Generator()
netG.apply(weights_init)
netD = Discriminator()
netD.apply(weights_init)
criterion = nn.BCELoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
real_label, fake_label = 1.0, 0.0

for i in range(10):
    real = torch.rand(batch, nc, 16, 16) * 2 - 1
    netD.zero_grad()
    label = torch.full((batch,), real_label)
    errD_real = criterion(netD(real), label)
    errD_real.backward()
    noise = torch.randn(batch, nz, 1, 1)
    fake = netG(noise)
    label.fill_(fake_label)
    errD_fake = criterion(netD(fake.detach()), label)
    errD_fake.backward()
    errD = errD_real + errD_fake
    optimizerD.step()

    netG.zero_grad()
    label.fill_(real_label)  # fake labels are real for the generator's cost
    errG = criterion(netD(fake), label)
    errG.backward()
    optimizerG.step()
    print(f"loss {i} {errD.item():.8e}")
    print(f"loss {i} {errG.item():.8e}")
