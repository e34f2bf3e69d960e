"""pytorch/examples time_sequence_prediction/train.py in small: two LSTMCells and a Linear
in float64, LBFGS(lr=0.8) with a closure (zero_grad, forward, MSE, backward inside it),
trained on shifted sine waves, then a prediction of the future under no_grad. 8 waves of
length 60 instead of 100 of 1000, hidden size 24 instead of 51, 3 steps."""
import numpy as np
import torch
from torch import nn

torch.manual_seed(0)
np.random.seed(0)
torch.set_num_threads(1)
H = 24


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, H)
        self.lstm2 = nn.LSTMCell(H, H)
        self.linear = nn.Linear(H, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), H, dtype=torch.double)
        c_t = torch.zeros(input.size(0), H, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), H, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), H, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


T, L, N = 20, 60, 8
x = np.empty((N, L), "int64")
x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
data = np.sin(x / 1.0 / T).astype("float64")
input = torch.from_numpy(data[2:, :-1])
target = torch.from_numpy(data[2:, 1:])
test_input = torch.from_numpy(data[:2, :-1])
seq = Sequence()
seq.double()
criterion = nn.MSELoss()
optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=8)
for i in range(3):
    def closure():
        optimizer.zero_grad()
        out = seq(input)
        loss = criterion(out, target)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    print(f"loss {i} {loss.item():.8e}")
    with torch.no_grad():
        pred = seq(test_input, future=10)
