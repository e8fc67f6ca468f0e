"""The CIFAR ResNets of He et al. 2016 (section 4.2), ResNet-20/32/44/56/110: three stages of n basic blocks at 16,
32 and 64 channels, 6n + 2 layers, with the paper's parameter-free shortcuts (option A)."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

DEPTHS = {"resnet20": 3, "resnet32": 5, "resnet44": 7, "resnet56": 9, "resnet110": 18}  # name -> blocks per stage


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
        self.stride, self.extra = stride, c_out - c_in

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        if self.stride > 1 or self.extra:  # option A: every other pixel, zero channels appended
            x = F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, 0, self.extra))
        return F.relu(out + x)


class CifarResNet(nn.Module):
    def __init__(self, blocks_per_stage: int, num_classes: int = 10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16)
        layers, c_in = [], 16
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks_per_stage):
                layers.append(BasicBlock(c_in, c_out, stride if i == 0 else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():  # He initialisation, as the paper (and torchvision's ResNets)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))
