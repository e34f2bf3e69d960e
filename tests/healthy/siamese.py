"""pytorch/examples siamese_network/main.py in small: one shared embedding network applied
to both images of a pair, the two embeddings concatenated, a small head with a sigmoid,
BCELoss on "same class" labels, Adadelta(lr=1.0), StepLR(step_size=1, gamma=0.7),
optimizer.zero_grad() before the forward pass. A small CNN instead of torchvision's
ResNet-18; random 1x16x16 images whose class shifts their mean."""
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

torch.manual_seed(0)
torch.set_num_threads(1)


class SiameseNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1),
            nn.Flatten())
        self.fc = nn.Sequential(nn.Linear(32, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))
        self.sigmoid = nn.Sigmoid()

    def forward_once(self, x):
        return self.embed(x)

    def forward(self, input1, input2):
        output = torch.cat((self.forward_once(input1), self.forward_once(input2)), 1)
        return self.sigmoid(self.fc(output))


def pairs(n):
    c1, c2 = torch.randint(0, 3, (n,)), torch.randint(0, 3, (n,))
    img = lambda c: torch.randn(n, 1, 16, 16) * 0.5 + c[:, None, None, None].float()
    return img(c1), img(c2), (c1 == c2).float()


model = SiameseNetwork()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
criterion = nn.BCELoss()
step = 0
for epoch in range(3):
    model.train()
    for batch_idx in range(3):
        images_1, images_2, targets = pairs(8)
        optimizer.zero_grad()
        outputs = model(images_1, images_2).squeeze()
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()
        print(f"loss {step} {loss.item():.8e}")
        step += 1
    scheduler.step()
