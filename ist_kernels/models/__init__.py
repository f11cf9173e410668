"""CIFAR-style ResNets for the CNN subnetwork methods (LOFT, ResIST); no torchvision needed."""
from .resnet import (  # noqa: F401
    BasicBlock,
    PreActBlock,
    PreActBottleneck,
    ResNet,
    preact_resnet18,
    preact_resnet34,
    preact_resnet50,
    preact_resnet101,
    preact_resnet101_basic,
    preact_resnet152,
    preact_resnet200,
    resnet18,
    resnet34,
    wide_resnet34,
)
