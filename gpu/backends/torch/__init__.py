"""The torch backend: the reference attention and ops, plain torch on any device and dtype."""

from conveyor.gpu.backends.torch.attention import TorchAttention, TorchMetadata
from conveyor.gpu.backends.torch.ops import TorchOps

__all__ = ["TorchAttention", "TorchMetadata", "TorchOps"]
