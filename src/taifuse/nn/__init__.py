"""Neural-network layers on taifuse Tensors, named and initialized as in ``torch.nn``.

Example::

    >>> import numpy as np, taifuse, taifuse.nn as nn
    >>> taifuse.set_backend("numpy")  # Tensors run on the host backends (numpy, numba) for now
    >>> taifuse.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(4, 8, activation="gelu"), nn.Linear(8, 2))
    >>> [name for name, _ in model.named_parameters()]
    ['0.weight', '0.bias', '1.weight', '1.bias']
    >>> model(taifuse.tensor(np.ones((3, 4), np.float32))).shape
    (3, 2)
"""

from taifuse.nn import utils as utils  # torch.nn.utils: fuse_conv_bn_eval
from taifuse.nn.batchnorm import BatchNorm1d, BatchNorm2d
from taifuse.nn.checkpoint import Checkpoint
from taifuse.nn.conv import AdaptiveAvgPool2d, AvgPool2d, Conv2d, Flatten, MaxPool2d
from taifuse.nn.fused import ConvBn2d, ConvBnReLU2d
from taifuse.nn.layers import (
    GELU,
    CausalSelfAttention,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    LeakyReLU,
    Linear,
    ModuleList,
    MSELoss,
    ReLU,
    RMSNorm,
    Sequential,
    Sigmoid,
    SiLU,
    Tanh,
)
from taifuse.nn.module import Module, Parameter

__all__ = [
    "GELU",
    "AdaptiveAvgPool2d",
    "AvgPool2d",
    "BatchNorm1d",
    "BatchNorm2d",
    "CausalSelfAttention",
    "Checkpoint",
    "Conv2d",
    "ConvBn2d",
    "ConvBnReLU2d",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "Flatten",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "MSELoss",
    "MaxPool2d",
    "Module",
    "ModuleList",
    "Parameter",
    "RMSNorm",
    "ReLU",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "Tanh",
]
