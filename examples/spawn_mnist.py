# An article's single-node mp.spawn DDP example, run as one task per GPU under hpc-ddp (on any number of
# nodes) and made preemption-safe with hpc_ddp. Ranks come from hpc-ddp instead of mp.spawn; the data is
# read from the staged copy (compute nodes rarely have internet), not downloaded.
#   hpc-ddp submit --nodes 2 --gpus 4 --stage data/mnist examples/spawn_mnist.py
import os
import hpc_ddp
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.optim as optim


def setup(rank, world_size):
    return hpc_ddp.start()  # MASTER_ADDR/PORT, backend and device from hpc-ddp


def cleanup(run):
    run.close()


import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class SimpleModel(nn.Module):
    def __init__(self):
        super(SimpleModel, self).__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(28*28, 10)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(10, 10)
        self.fc3 = nn.Linear(10, 10)

    def forward(self, x):
        x = self.flatten(x)
        x = self.fc1(x)
        x = self.relu(x)
        x = self.fc2(x)
        x = self.relu(x)
        x = self.fc3(x)
        return x


def create_model():
    return SimpleModel()


from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms


def create_dataloader(run, batch_size=32):
    transform = transforms.Compose([transforms.ToTensor()])
    dataset = datasets.MNIST(root=os.environ.get('DATASETS_PATH', './data') + '/mnist', train=True, download=False,
                             transform=transform)
    sampler = run.sampler(dataset, batch_size=batch_size)
    dataloader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    return dataloader


def train(rank, world_size, epochs=5):
    run = setup(rank, world_size)
    dataloader = create_dataloader(run)
    torch.manual_seed(0)
    model = create_model().to(run.device)
    ddp_model = DDP(model, device_ids=run.device_ids)
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    run.track(model=ddp_model, optimizer=optimizer)
    run.resume()
    for epoch in run.epochs(epochs):
        ddp_model.train()
        for batch_idx, (data, target) in enumerate(dataloader):
            data, target = data.to(run.device), target.to(run.device)
            optimizer.zero_grad()
            output = ddp_model(data)
            loss = criterion(output, target)
            loss.backward()
            optimizer.step()
            run.step(loss)
        if rank == 0:
            print(f"Epoch {epoch} complete")
    run.finish()
    cleanup(run)


def main():
    # One task per GPU: hpc-ddp starts every rank (no mp.spawn)
    train(int(os.environ['RANK']), int(os.environ['WORLD_SIZE']), int(os.environ.get('EPOCHS', 5)))


if __name__ == "__main__":
    main()
