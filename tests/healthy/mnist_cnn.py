"""pytorch/examples mnist/main.py in small: the same Net (conv 32, conv 64, max-pool,
dropout, fc 128, log_softmax), Adadelta(lr=1.0), StepLR(step_size=1, gamma=0.7) stepped
every "epoch", optimizer.zero_grad() before the forward pass, NLL loss. Random 28x28
images, 3 epochs of 2 batches of 8."""
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import StepLR

torch.manual_seed(0)
torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


model = Net()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
step = 0
for epoch in range(3):
    model.train()
    for batch_idx in range(2):
        data, target = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        print(f"loss {step} {loss.item():.8e}")
        step += 1
    scheduler.step()
