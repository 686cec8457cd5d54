"""Models built on jax_brgemm layers, each switchable to stock XLA layers (``impl="xla"``)."""

from .layers import ACTIVATIONS, IMPLS, LAYERS, Layers, activated, layers, stock_lstm
from .lstm import GNMTEncoder, LSTMClassifier
from .mlp import MLP
from .resnet import BottleneckResNetBlock, ResNet, ResNet18, ResNet34, ResNet50, ResNetBlock
from .transformer import EncoderBlock, TransformerEncoder, ViT

__all__ = ["ACTIVATIONS", "IMPLS", "LAYERS", "BottleneckResNetBlock", "EncoderBlock", "GNMTEncoder",
           "LSTMClassifier", "Layers", "MLP", "ResNet", "ResNet18", "ResNet34", "ResNet50", "ResNetBlock",
           "TransformerEncoder", "ViT", "activated", "layers", "stock_lstm"]
