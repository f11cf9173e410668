"""CIFAR-style ResNets for the CNN subnetwork methods (LOFT, ResIST) and small GPT-style transformers
(``gpt_tiny``, ``gpt_small``: IST and ResIST on byte-level language modelling); no torchvision needed."""
from .gpt import GPT, GPT_SIZES, LANGUAGE_MODELS, gpt_small, gpt_tiny  # noqa: F401
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
