"""Models of the studies: a feature backbone plus the head the loss needs.

``build_model(model_config, num_classes, input_shape, head)`` returns a ``Classifier``
whose ``forward`` gives a score tensor (B, L), or a ``TwoHeadOutput`` for ``head:
two_head``. Backbones:

- ``mlp``: two hidden layers of ``hidden_dim`` units (synthetic feature vectors, or
  flattened images);
- ``small_cnn``: three conv blocks and global average pooling (3xHxW images);
- ``densenet_bc_cifar``: the CIFAR DenseNet-BC of the papers, depth 40, growth rate 40
  (``model.depth``, ``model.growth_rate``; 40-12 in [BZK18] Table 6),
  bottleneck layers, compression 0.5, no dropout, feature dimension 440 at 40-40
  (docs/papers.md, note P-1), written here from the
  DenseNet paper's description ([Hua+17] §3 "DenseNet-BC");
- ``densenet_cifar``: the original CIFAR DenseNet of [Hua+17] (§3, Table 2 "DenseNet"),
  without bottleneck layers or compression: 16 maps after the first convolution, three
  dense blocks of (depth - 4) / 3 BN-ReLU-Conv(3x3) layers, depth 3n + 4 (``model.depth``,
  ``model.growth_rate``); DenseNet (L=40, k=12) has 448 features and 1.06 M parameters
  with a 100-class classifier (1.02 M with 10 classes: the "1.0M" of [Hua+17] Table 2);
- any timm architecture by name (``resnet18``, ``resnet50``, ``densenet121``,
  ``vit_small_patch16_224``, ...), created without its classifier.

Heads (docs/interfaces.md section 1, ``model.head``): ``linear``; ``normed`` (the cosine
layer ``NormedLinear`` of ``setvalued.losses.normed``, used by LDAM and the imbalanced
noised top-K loss, docs/papers.md, note T-N4); ``two_head``
(``TwoHeadClassifier`` of ``setvalued.losses.avgk``, thesis section 5.5.2).

Pre-trained weights (``model.pretrained``) are never downloaded: a path names a local
weights file; ``true`` looks the model's default weights up in the local Hugging Face and
torch hub caches only, and fails with a message saying where to put a file otherwise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from setvalued import registry
from setvalued.config import BUILTIN_MODELS as OWN_MODELS  # the models built here, not by timm
from setvalued.config import HEADS, MODEL_DEFAULTS, reject_unknown_keys

#: the DenseNets built here, which read ``model.depth`` and ``model.growth_rate``
DENSENETS = ("densenet_bc_cifar", "densenet_cifar")


class Classifier(nn.Module):
    """``head(backbone(x))``; ``features(x)`` gives the penultimate features."""

    def __init__(self, backbone: nn.Module, head: nn.Module, feature_dim: int, head_kind: str):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.feature_dim = feature_dim
        self.head_kind = head_kind

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> Any:
        return self.head(self.backbone(x))


# ---------------------------------------------------------------------------------------------
# small backbones
# ---------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Flatten, then two ReLU layers of ``hidden_dim`` units (no batch norm, so a batch of
    one example trains too)."""

    def __init__(self, in_features: int, hidden_dim: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(inplace=True),
        )
        self.out_features = hidden_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Three 3x3 conv + BN + ReLU blocks (32, 64, ``hidden_dim`` channels), max pooling after
    the first two, global average pooling."""

    def __init__(self, in_channels: int, hidden_dim: int):
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        self.net = nn.Sequential(
            *block(in_channels, 32),
            nn.MaxPool2d(2),
            *block(32, 64),
            nn.MaxPool2d(2),
            *block(64, hidden_dim),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.out_features = hidden_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# ---------------------------------------------------------------------------------------------
# DenseNet-BC and DenseNet for 32x32 images
# ---------------------------------------------------------------------------------------------


class _Bottleneck(nn.Module):
    """BN-ReLU-Conv(1x1, 4k)-BN-ReLU-Conv(3x3, k); the k new maps are concatenated to the input."""

    def __init__(self, in_channels: int, growth_rate: int):
        super().__init__()
        inter = 4 * growth_rate
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, inter, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(inter)
        self.conv2 = nn.Conv2d(inter, growth_rate, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return torch.cat([x, out], dim=1)


class _Transition(nn.Module):
    """BN-ReLU-Conv(1x1) to ``out_channels``, then 2x2 average pooling."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(in_channels)
        self.conv = nn.Conv2d(in_channels, out_channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(self.conv(F.relu(self.bn(x))), 2)


def _init_densenet(model: nn.Module) -> None:
    """He initialisation over the fan-out for the convolutions, as the DenseNet reference
    code does; BN weights 1, biases 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
            nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class DenseNetBC(nn.Module):
    """DenseNet-BC for CIFAR (Huang et al. 2017): three dense blocks of (depth-4)/6 bottleneck
    layers, 2k channels after the first convolution, transitions that keep ``floor(0.5 c)``
    channels, final BN-ReLU and global average pooling. Depth 40, growth 40: 6 layers per
    block, 80 -> 320 -> 160 -> 400 -> 200 -> 440 channels, so ``out_features`` = 440.
    """

    def __init__(self, depth: int = 40, growth_rate: int = 40, reduction: float = 0.5, in_channels: int = 3):
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"DenseNet-BC depth must be 6n + 4, got {depth}")
        layers_per_block = (depth - 4) // 6
        channels = 2 * growth_rate
        self.conv1 = nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)
        blocks: list[nn.Module] = []
        for b in range(3):
            layers = []
            for _ in range(layers_per_block):
                layers.append(_Bottleneck(channels, growth_rate))
                channels += growth_rate
            blocks.append(nn.Sequential(*layers))
            if b < 2:
                out = int(math.floor(channels * reduction))
                blocks.append(_Transition(channels, out))
                channels = out
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(channels)
        self.out_features = channels
        _init_densenet(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn(self.blocks(self.conv1(x))))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)


class _DenseLayer(nn.Module):
    """BN-ReLU-Conv(3x3, k); the k new maps are concatenated to the input."""

    def __init__(self, in_channels: int, growth_rate: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(in_channels)
        self.conv = nn.Conv2d(in_channels, growth_rate, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.conv(F.relu(self.bn(x)))], dim=1)


class DenseNet(nn.Module):
    """The original DenseNet for CIFAR ([Hua+17] §3 and Table 2 "DenseNet"; not DenseNet-BC):
    a 3x3 convolution to 16 maps, three dense blocks of (depth-4)/3 layers BN-ReLU-Conv(3x3, k)
    (no bottleneck), transitions BN-ReLU-Conv(1x1) keeping the channel count (no compression)
    and 2x2 average pooling, final BN-ReLU and global average pooling; no dropout (the paper
    uses dropout only without data augmentation). Depth 40, growth 12: 12 layers per block,
    16 -> 160 -> 304 -> 448 channels, so ``out_features`` = 448.
    """

    STEM_CHANNELS = 16

    def __init__(self, depth: int = 40, growth_rate: int = 12, in_channels: int = 3):
        super().__init__()
        if depth < 4 or (depth - 4) % 3:
            raise ValueError(f"DenseNet depth must be 3n + 4, got {depth}")
        layers_per_block = (depth - 4) // 3
        channels = self.STEM_CHANNELS
        self.conv1 = nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)
        blocks: list[nn.Module] = []
        for b in range(3):
            layers = []
            for _ in range(layers_per_block):
                layers.append(_DenseLayer(channels, growth_rate))
                channels += growth_rate
            blocks.append(nn.Sequential(*layers))
            if b < 2:
                blocks.append(_Transition(channels, channels))
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(channels)
        self.out_features = channels
        _init_densenet(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn(self.blocks(self.conv1(x))))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)


# ---------------------------------------------------------------------------------------------
# timm and pre-trained weights
# ---------------------------------------------------------------------------------------------


def _cached_weights(name: str) -> str | None:
    """A local copy of timm's default weights for ``name`` (Hugging Face or torch hub cache), or None."""
    import timm.models

    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None:
        return None
    hub_id = getattr(cfg, "hf_hub_id", None)
    if hub_id:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:  # pragma: no cover - huggingface_hub is a timm dependency
            try_to_load_from_cache = None  # type: ignore[assignment]
        if try_to_load_from_cache is not None:
            for filename in ("model.safetensors", "pytorch_model.bin"):
                found = try_to_load_from_cache(repo_id=hub_id, filename=filename)
                if isinstance(found, str) and os.path.isfile(found):
                    return found
    url = getattr(cfg, "url", None)
    if url:
        path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url.split("?")[0]))
        if os.path.isfile(path):
            return path
    return None


def resolve_pretrained(pretrained: Any, name: str) -> str | None:
    """The local weights file of ``model.pretrained`` (False/None: no weights)."""
    if pretrained is None or pretrained is False:
        return None
    if pretrained is True:
        if name in OWN_MODELS:
            raise ValueError(
                f"model.pretrained: true has no default weights for {name!r}; give the path of a local weights file"
            )
        path = _cached_weights(name)
        if path is None:
            raise FileNotFoundError(
                f"model.pretrained: true, but no cached weights for timm model {name!r} were found in the "
                "local Hugging Face or torch hub caches, and weights are never downloaded. Put the weights "
                "file on this machine and set model.pretrained to its path (a .safetensors, .pth or .bin "
                "state dict)"
            )
        return path
    if isinstance(pretrained, (str, os.PathLike)):
        path = os.path.expanduser(os.fspath(pretrained))
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"model.pretrained: weights file {path!r} does not exist (weights are "
                "read only from a local file, never downloaded)"
            )
        return path
    raise ValueError(f"model.pretrained must be false, true or the path of a local weights file, got {pretrained!r}")


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors file or a torch file (unwrapping 'state_dict'/'model')."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"model.pretrained: cannot read weights file {path!r}: {err}") from err
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
            break
    if not isinstance(state, dict):
        raise ValueError(f"model.pretrained: {path!r} does not hold a state dict")
    return {k[len("module.") :] if k.startswith("module.") else k: v for k, v in state.items()}


def timm_backbone(name: str, in_chans: int, weights: str | None) -> tuple[nn.Module, int]:
    """A timm model without classifier (``num_classes=0``), optionally with local weights.

    The weights file must hold the architecture's state dict in timm's key layout (the
    files of timm's Hugging Face and torch hub caches; torchvision's ResNet files share it).
    The classifier's entries are dropped; any other missing or unexpected entry is an error
    (timm's own loader would only warn). The width returned is that of the features the
    backbone outputs: ``head_hidden_size`` where timm puts a pre-logits layer before the
    classifier (MobileNetV3: 288 channels pooled, then 1024 features), else ``num_features``.
    """
    import timm

    if not timm.is_model(name):
        raise ValueError(
            f"model.name {name!r} is neither one of {', '.join(OWN_MODELS)} nor a timm "
            "architecture (see timm.list_models())"
        )
    model = timm.create_model(name, pretrained=False, num_classes=0, in_chans=in_chans)
    if weights is not None:
        state = read_state_dict(weights)
        classifier = cast(dict[str, Any], model.pretrained_cfg).get("classifier") or ()
        prefixes = tuple(f"{c}." for c in ((classifier,) if isinstance(classifier, str) else classifier))
        state = {k: v for k, v in state.items() if not (prefixes and k.startswith(prefixes))}
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as err:  # shape mismatches
            raise ValueError(
                f"model.pretrained: weights file {weights!r} does not fit timm model {name!r}: {err}"
            ) from err
        if missing or unexpected:
            raise ValueError(
                f"model.pretrained: weights file {weights!r} does not fit timm model {name!r}: "
                f"{len(missing)} missing entries (e.g. {missing[:3]}), {len(unexpected)} unexpected "
                f"entries (e.g. {unexpected[:3]})"
            )
    width: Any = getattr(model, "head_hidden_size", None) or model.num_features
    return model, int(width)


# ---------------------------------------------------------------------------------------------
# heads and the factory
# ---------------------------------------------------------------------------------------------


def build_head(kind: str, in_features: int, num_classes: int) -> nn.Module:
    if kind == "linear":
        return nn.Linear(in_features, num_classes)
    if kind == "normed":
        from setvalued.losses.normed import NormedLinear

        return NormedLinear(in_features, num_classes)
    if kind == "two_head":
        from setvalued.losses.avgk import TwoHeadClassifier

        return TwoHeadClassifier(in_features, num_classes)
    raise ValueError(f"model.head must be one of auto, {', '.join(HEADS)}, got {kind!r}")


def build_model(
    model_config: dict[str, Any], num_classes: int, input_shape: Sequence[int], head: str = "linear"
) -> Classifier:
    """The model of a ``model`` config for inputs of ``input_shape`` (without batch axis).

    ``head`` is the resolved head kind (``model.head``, or the loss's ``head`` when it is
    ``auto``); the trainer resolves it.
    """
    item = registry.entry("model", model_config.get("name"))
    if item is not None and not item.builtin:
        return _build_plugin(item, model_config, num_classes, input_shape, head)
    reject_unknown_keys("model", model_config, MODEL_DEFAULTS)
    cfg = {**MODEL_DEFAULTS, **model_config}
    name = cfg["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"model.name must be a model name, got {name!r}")
    hidden = cfg["hidden_dim"]
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"model.hidden_dim must be a positive integer, got {hidden!r}")
    for key in ("depth", "growth_rate"):
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.{key} must be a positive integer, got {value!r}")
        if name not in DENSENETS and value != MODEL_DEFAULTS[key]:
            raise ValueError(f"model.{key} applies to model.name {' or '.join(DENSENETS)} only, not {name!r}")
    input_shape = tuple(int(s) for s in input_shape)
    is_image = len(input_shape) == 3
    weights = resolve_pretrained(cfg["pretrained"], name)

    if name not in OWN_MODELS:
        import timm

        if not timm.is_model(name):
            raise ValueError(
                f"model.name {name!r} is neither one of {', '.join(OWN_MODELS)} nor a timm "
                "architecture (see timm.list_models())"
            )
    if name != "mlp" and not is_image:
        raise ValueError(
            f"model.name {name!r} needs image inputs (C, H, W), but the data are vectors of "
            f"shape {input_shape} (use model.name: mlp, or data.form: images)"
        )
    backbone: nn.Module
    if name == "mlp":
        backbone = MLP(math.prod(input_shape), hidden)
    elif name == "small_cnn":
        backbone = SmallCNN(input_shape[0], hidden)
    elif name == "densenet_bc_cifar":
        backbone = DenseNetBC(depth=cfg["depth"], growth_rate=cfg["growth_rate"], in_channels=input_shape[0])
    elif name == "densenet_cifar":
        backbone = DenseNet(depth=cfg["depth"], growth_rate=cfg["growth_rate"], in_channels=input_shape[0])
    else:
        backbone, timm_width = timm_backbone(name, input_shape[0], weights)
        weights = None  # loaded by timm_backbone
    if weights is not None:
        state = read_state_dict(weights)
        try:
            backbone.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"model.pretrained: weights file {weights!r} does not fit model {name!r}: {err}") from err
    feature_dim = timm_width if name not in OWN_MODELS else int(cast(int, backbone.out_features))
    if head not in HEADS:
        raise ValueError(f"model.head must be one of auto, {', '.join(HEADS)}, got {head!r}")
    return Classifier(backbone, build_head(head, feature_dim, num_classes), feature_dim, head)


def _build_plugin(
    item: registry.Entry, model_config: dict[str, Any], num_classes: int, input_shape: Sequence[int], head: str
) -> Classifier:
    """A plugin model: its backbone from its builder (declared parameters checked), then the head.
    The built-in fields a default config holds (at their defaults) are not passed."""
    params = registry.plugin_parameters(item, model_config, MODEL_DEFAULTS)
    backbone = registry.load_factory("model", item.name)(input_shape=tuple(int(s) for s in input_shape), **params)
    feature_dim = getattr(backbone, "out_features", None)
    if not isinstance(backbone, nn.Module) or not isinstance(feature_dim, int):
        raise registry.PluginError(
            f"model {item.name!r} ({item.origin}): {item.factory} must return an "
            "nn.Module with an integer out_features (its feature size)"
        )
    if head not in HEADS:
        raise ValueError(f"model.head must be one of auto, {', '.join(HEADS)}, got {head!r}")
    return Classifier(backbone, build_head(head, feature_dim, num_classes), feature_dim, head)
