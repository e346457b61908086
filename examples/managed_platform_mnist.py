# A managed platform's MNIST DDP example (env contract: BACKEND, WORLD_SIZE, BATCH_SIZE, EPOCHS, LR,
# WORKER_PER_NODE, WORKSPACE, DATASETS_PATH, DATASETS, --local_rank), made preemption-safe with hpc_ddp:
# a stop request checkpoints and exits 75, a requeued job resumes at the same sample, bitwise.
#   hpc-ddp submit --nodes 2 --gpus 1 --stage data/mnist --pass-local-rank examples/managed_platform_mnist.py
import os
import hpc_ddp
import argparse
import torch
import torchvision
from torch import distributed as dist
from torch.utils.data import DataLoader
from torchvision.datasets import MNIST
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
import numpy as np

world_size = int(os.getenv("WORLD_SIZE", 2))
batch_size = int(os.getenv("BATCH_SIZE", 128))
epochs = int(os.getenv("EPOCHS", 5))
lr = float(os.getenv("LR", 0.001))
backend = os.getenv("BACKEND", "nccl")
worker_per_node = int(os.getenv("WORKER_PER_NODE", 1))
workspace_path = os.getenv("WORKSPACE")
datasets_path = os.getenv("DATASETS_PATH")


def get_datasets():
    # The mounted datasets will be separated by commas
    datasets = os.getenv("DATASETS", "")
    return datasets.split(",")


def get_dataset():
    datasets = get_datasets()
    if len(datasets) > 0:
        return datasets[0]
    return ""


def reduce_loss(tensor, rank):
    with torch.no_grad():
        dist.reduce(tensor, dst=0)
        if rank == 0:
            tensor /= world_size


parser = argparse.ArgumentParser()
# 注意这个参数,必须要以这种形式指定,即使代码中不使用。因为 launch 工具默认传递该参数
parser.add_argument('--local_rank', type=int, help="local gpu/cpu device id")
args = parser.parse_args()
run = hpc_ddp.start()  # the process group, after a rendezvous that names missing ranks
torch.manual_seed(0)  # the same initial weights in every attempt
# Need to put tensor on a cpu/gpu device
local_rank = args.local_rank
device_ids = [local_rank]
output_device = local_rank
if backend == 'nccl':
    device = torch.device("cuda:{}".format(local_rank))
else:
    device = torch.device("cpu:{}".format(local_rank))
    # For multi-device modules and CPU modules, it must be ``None``
    device_ids = None
    output_device = None
global_rank = dist.get_rank()
from torchvision.models.resnet import ResNet, BasicBlock


class MnistResNet(ResNet):
    def __init__(self):
        super(MnistResNet, self).__init__(BasicBlock, [2, 2, 2, 2], num_classes=10)
        self.conv1 = torch.nn.Conv2d(1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)

    def forward(self, x):
        return torch.softmax(super(MnistResNet, self).forward(x), dim=-1)


net = MnistResNet()
net.to(device)
if backend == 'nccl':
    # SyncBatchNorm layers only work with GPU modules
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)
net = DDP(net, device_ids=device_ids, output_device=output_device)


class ToNumpy(object):
    def __call__(self, sample):
        return np.array(sample)


data_root = "{}/{}".format(datasets_path, get_dataset())
# Data should be prefetched
# Download should be set to be False, because it is not multiprocess safe
"""
root (string): Root directory of dataset where ``MNIST/raw/train-images-idx3-ubyte``
and ``MNIST/raw/t10k-images-idx3-ubyte`` exist.
train (bool, optional): If True, creates dataset from ``train-images-idx3-ubyte``,
otherwise from ``t10k-images-idx3-ubyte``.
"""
train_set = MNIST(root=data_root,
                  download=False,
                  train=True,
                  transform=torchvision.transforms.Compose(
                      [ToNumpy(), torchvision.transforms.ToTensor()])
                  )
value_set = MNIST(root=data_root,
                  download=False,
                  train=False,
                  transform=torchvision.transforms.Compose(
                      [ToNumpy(), torchvision.transforms.ToTensor()])
                  )
sampler = run.sampler(train_set, batch_size=batch_size)  # DistributedSampler's order, resumable
train_loader = DataLoader(train_set,
                          batch_size=batch_size,
                          shuffle=False,
                          pin_memory=True,
                          sampler=sampler,
                          num_workers=worker_per_node)
value_loader = DataLoader(value_set,
                          batch_size=batch_size,
                          shuffle=False,
                          pin_memory=True,
                          num_workers=worker_per_node)
criterion = torch.nn.CrossEntropyLoss()
opt = torch.optim.Adam(net.parameters(), lr=lr)
run.track(model=net, optimizer=opt)
run.resume()
net.train()
for e in run.epochs(epochs):
    print("Local Rank: {}, Epoch: {}, Training ...".format(local_rank, e))
    # DistributedSampler deterministically shuffle data
    # by seting random seed be current number epoch
    # so if do not call set_epoch when start of one epoch
    # the order of shuffled data will be always same
    sampler.set_epoch(e)
    for idx, (imgs, labels) in enumerate(train_loader):
        imgs = imgs.to(device)
        labels = labels.to(device)
        output = net(imgs)
        loss = criterion(output, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.step(loss)  # a stop agreed by all ranks: checkpoint, exit 75
        reduce_loss(loss, global_rank)
        if idx % 10 == 0 and global_rank == 0 and local_rank == 0:
            print('Epoch: {} step: {} loss: {}'.format(e, idx, loss.item()))
run.finish()
net.eval()
with torch.no_grad():
    cnt = 0
    total = len(value_loader.dataset)
    for imgs, labels in value_loader:
        imgs, labels = imgs.to(device), labels.to(device)
        output = net(imgs)
        predict = torch.argmax(output, dim=1)
        cnt += (predict == labels).sum().item()
if global_rank == 0:
    print('eval accuracy: {}'.format(cnt / total))
