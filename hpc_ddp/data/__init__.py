"""Datasets: torchvision loaders with resumable sampling, MNIST/CIFAR-10 samples made from their arrays,
synthetic datasets in real formats, and node-local staging."""
