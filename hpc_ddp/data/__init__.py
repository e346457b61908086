"""Datasets: torchvision loaders with resumable sampling, synthetic datasets in real formats, and node-local staging."""
