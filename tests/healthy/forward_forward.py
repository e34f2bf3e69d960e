"""pytorch/examples mnist_forward_forward/main.py in small: each layer has its own Adam
optimizer (lr=0.03) and is trained on its own for a few epochs, on the goodness of positive
vs negative data (log1p(exp(threshold - g_pos, g_neg - threshold))), the inputs of the next
layer detached. Random data with the label overlaid on the first 10 inputs."""
import torch
from torch import nn
from torch.optim import Adam

torch.manual_seed(0)
torch.set_num_threads(1)
STEP = [0]


def overlay_y_on_x(x, y):
    x_ = x.clone()
    x_[:, :10] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_


class Layer(nn.Linear):
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features)
        self.relu = nn.ReLU()
        self.opt = Adam(self.parameters(), lr=0.03)
        self.threshold = 2.0
        self.num_epochs = 12

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def train_layer(self, x_pos, x_neg):
        for _ in range(self.num_epochs):
            g_pos = self.forward(x_pos).pow(2).mean(1)
            g_neg = self.forward(x_neg).pow(2).mean(1)
            loss = torch.log1p(torch.exp(torch.cat([-g_pos + self.threshold, g_neg - self.threshold]))).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            print(f"loss {STEP[0]} {loss.item():.8e}")
            STEP[0] += 1
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


class Net(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.layers = nn.ModuleList(Layer(dims[d], dims[d + 1]) for d in range(len(dims) - 1))

    def train_net(self, x_pos, x_neg):
        h_pos, h_neg = x_pos, x_neg
        for layer in self.layers:
            h_pos, h_neg = layer.train_layer(h_pos, h_neg)


x = torch.rand(64, 48)
y = torch.randint(0, 10, (64,))
net = Net([48, 64, 64])
x_pos = overlay_y_on_x(x, y)
x_neg = overlay_y_on_x(x, y[torch.randperm(x.size(0))])
net.train_net(x_pos, x_neg)
