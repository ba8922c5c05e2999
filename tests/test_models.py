"""Models: the CIFAR DenseNet-BC and DenseNet, the small backbones, timm by name with local
weights only, and the three heads."""

from __future__ import annotations

import os

import pytest
import torch

from setvalued.losses import TwoHeadOutput
from setvalued.models import DenseNet, DenseNetBC, build_model

torch.set_num_threads(1)


def densenet_bc_parameter_count(depth: int, growth: int, num_classes: int) -> int:
    """Parameters of DenseNet-BC (Huang et al. 2017, section 3) counted from its description:
    3x3 stem conv to 2k maps; 3 blocks of (depth-4)/6 bottlenecks BN-1x1(4k)-BN-3x3(k);
    transitions BN-1x1 to floor(c/2) maps; final BN; linear classifier."""
    n = (depth - 4) // 6
    c = 2 * growth
    total = 3 * c * 9
    for block in range(3):
        for _ in range(n):
            total += 2 * c + c * 4 * growth + 2 * 4 * growth + 4 * growth * growth * 9
            c += growth
        if block < 2:
            total += 2 * c + c * (c // 2)
            c //= 2
    return total + 2 * c + c * num_classes + num_classes


def test_densenet_bc_40_40():
    model = build_model({"name": "densenet_bc_cifar"}, 100, (3, 32, 32))
    assert model.feature_dim == 440  # docs/papers.md, note P-1
    assert sum(p.numel() for p in model.parameters()) == densenet_bc_parameter_count(40, 40, 100)
    bottlenecks = [m for m in model.modules() if type(m).__name__ == "_Bottleneck"]
    assert len(bottlenecks) == 18
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 100)
    # other depths follow the same rule
    small = DenseNetBC(depth=16, growth_rate=12)  # 2 layers a block: 24 -> 48 -> 24 -> 48 -> 24 -> 48
    assert small.out_features == 48
    assert sum(p.numel() for p in small.parameters()) == densenet_bc_parameter_count(16, 12, 0)
    with pytest.raises(ValueError, match="6n \\+ 4"):
        DenseNetBC(depth=41)
    # DenseNet 40-12 of [BZK18] Table 6 through the model config: 12 -> 24 + 6*12 = 96 -> 48
    # -> 120 -> 60 -> 132 channels
    bc_40_12 = build_model({"name": "densenet_bc_cifar", "depth": 40, "growth_rate": 12}, 100, (3, 32, 32))
    assert bc_40_12.feature_dim == 132
    assert sum(p.numel() for p in bc_40_12.parameters()) == densenet_bc_parameter_count(40, 12, 100)
    with pytest.raises(
        ValueError, match="model.growth_rate applies to model.name densenet_bc_cifar or densenet_cifar only"
    ):
        build_model({"name": "small_cnn", "growth_rate": 12}, 10, (3, 32, 32))
    with pytest.raises(ValueError, match="model.depth must be a positive integer"):
        build_model({"name": "densenet_bc_cifar", "depth": 0}, 10, (3, 32, 32))


def densenet_parameter_count(depth: int, growth: int, num_classes: int) -> int:
    """Parameters of the original DenseNet ([Hua+17] §3, no bottleneck, no compression) counted
    from its description: 3x3 stem conv to 16 maps; 3 blocks of (depth-4)/3 layers BN-3x3(k);
    transitions BN-1x1 to the same c; final BN; linear classifier."""
    n = (depth - 4) // 3
    c = 16
    total = 3 * c * 9
    for block in range(3):
        for _ in range(n):
            total += 2 * c + 9 * c * growth
            c += growth
        if block < 2:
            total += 2 * c + c * c
    return total + 2 * c + c * num_classes + num_classes


def test_densenet_40_12_is_the_published_one():
    """DenseNet (L=40, k=12) of [Hua+17] Table 2 ("1.0M" parameters), the network [BZK18]
    names for its temperature study (Table 6, Fig. 2)."""
    model = build_model({"name": "densenet_cifar", "depth": 40, "growth_rate": 12}, 100, (3, 32, 32))
    assert model.feature_dim == 448  # 16 + 3 * 12 * 12
    count = sum(p.numel() for p in model.parameters())
    assert count == densenet_parameter_count(40, 12, 100) == 1_060_132
    assert not any(type(m).__name__ == "_Bottleneck" for m in model.modules())
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 1 + 36 + 2  # stem, 3 x 12 layers, 2 transitions: depth 40 with the classifier
    assert sum(c.kernel_size == (3, 3) for c in convs) == 37
    # Table 2's parameter column counts a 10-class classifier (CIFAR-10): 1.02 M rounds to the
    # published 1.0M, and the deeper DenseNets of the table match too (7.0M, 27.2M); with the
    # 100 classes of CIFAR-100 the 40-12 network has 1.06 M parameters.
    cifar10 = build_model({"name": "densenet_cifar", "depth": 40, "growth_rate": 12}, 10, (3, 32, 32))
    count10 = sum(p.numel() for p in cifar10.parameters())
    assert count10 == densenet_parameter_count(40, 12, 10) == 1_019_722
    assert f"{count10 / 1e6:.1f}M" == "1.0M"
    assert f"{count / 1e6:.2f}M" == "1.06M"
    assert f"{densenet_parameter_count(100, 12, 10) / 1e6:.1f}M" == "7.0M"
    assert f"{densenet_parameter_count(100, 24, 10) / 1e6:.1f}M" == "27.2M"
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    # depth 3n + 4: 16 -> 16 + 2 * 4 = 24 -> 32 -> 40 channels at depth 10, growth 4
    small = DenseNet(depth=10, growth_rate=4)
    assert small.out_features == 40
    assert sum(p.numel() for p in small.parameters()) == densenet_parameter_count(10, 4, 0)
    with pytest.raises(ValueError, match="3n \\+ 4"):
        DenseNet(depth=41)


def test_small_backbones_and_heads():
    x = torch.randn(5, 3, 32, 32)
    mlp = build_model({"name": "mlp", "hidden_dim": 16}, 7, (3, 32, 32))
    assert mlp(x).shape == (5, 7) and mlp.feature_dim == 16
    cnn = build_model({"name": "small_cnn", "hidden_dim": 24}, 7, (3, 32, 32), head="two_head")
    out = cnn(x)
    assert isinstance(out, TwoHeadOutput) and out.sccp.shape == out.ml.shape == (5, 7)
    assert not torch.equal(out.sccp, out.ml)  # independent heads
    normed = build_model({"name": "mlp", "hidden_dim": 16}, 7, (12,), head="normed")
    cos = normed(torch.randn(9, 12))
    assert cos.shape == (9, 7) and cos.abs().max() <= 1 + 1e-6
    # a cosine head: scaling the features does not change the scores
    feats = normed.features(torch.randn(3, 12))
    torch.testing.assert_close(normed.head(feats), normed.head(3.0 * feats))
    mlp(torch.randn(1, 3, 32, 32)).sum().backward()  # a batch of one trains (no BatchNorm in the MLP)

    with pytest.raises(ValueError, match="needs image inputs"):
        build_model({"name": "small_cnn"}, 7, (12,))
    with pytest.raises(ValueError, match="model.head"):
        build_model({"name": "mlp"}, 7, (12,), head="cosine")
    with pytest.raises(ValueError, match="model.widht"):
        build_model({"name": "mlp", "widht": 3}, 7, (12,))
    with pytest.raises(ValueError, match="not_a_net"):
        build_model({"name": "not_a_net"}, 7, (3, 32, 32))


def test_timm_by_name_with_local_weights(tmp_path):
    import timm

    torch.manual_seed(0)
    reference = timm.create_model("resnet18", num_classes=1000)
    path = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), path)
    model = build_model({"name": "resnet18", "pretrained": str(path)}, 10, (3, 32, 32))
    assert model.feature_dim == 512
    torch.testing.assert_close(model.backbone.conv1.weight, reference.conv1.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.backbone.layer4[1].bn2.running_var, reference.layer4[1].bn2.running_var)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)

    from safetensors.torch import save_file

    st_path = tmp_path / "resnet18.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(st_path))
    model = build_model({"name": "resnet18", "pretrained": str(st_path)}, 10, (3, 32, 32), head="normed")
    torch.testing.assert_close(model.backbone.conv1.weight, reference.conv1.weight, rtol=0, atol=0)

    # weights of another architecture, or a file that is not there: clear errors, no download
    other = tmp_path / "resnet34.pth"
    torch.save(timm.create_model("resnet34", num_classes=1000).state_dict(), other)
    with pytest.raises(ValueError, match="resnet34.pth"):
        build_model({"name": "resnet18", "pretrained": str(other)}, 10, (3, 32, 32))
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        build_model({"name": "resnet18", "pretrained": str(tmp_path / "missing.pth")}, 10, (3, 32, 32))


def test_pretrained_true_reads_only_local_caches(tmp_path, monkeypatch):
    import huggingface_hub.constants
    import timm

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    old_hub_dir = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "torch_hub"))
    try:
        with pytest.raises(FileNotFoundError, match="never downloaded"):
            build_model({"name": "resnet18", "pretrained": True}, 10, (3, 32, 32))
        # the torch hub cache file of timm's default weights is used when it is there
        url = timm.models.get_pretrained_cfg("resnet18").url
        cached = tmp_path / "torch_hub" / "checkpoints" / os.path.basename(url)
        cached.parent.mkdir(parents=True)
        torch.manual_seed(1)
        reference = timm.create_model("resnet18", num_classes=1000)
        torch.save(reference.state_dict(), cached)
        model = build_model({"name": "resnet18", "pretrained": True}, 10, (3, 32, 32))
        torch.testing.assert_close(model.backbone.conv1.weight, reference.conv1.weight, rtol=0, atol=0)
    finally:
        torch.hub.set_dir(old_hub_dir)
    with pytest.raises(ValueError, match="no default weights"):
        build_model({"name": "mlp", "pretrained": True}, 10, (12,))


def test_own_model_weights_from_file(tmp_path):
    torch.manual_seed(0)
    source = build_model({"name": "mlp", "hidden_dim": 8}, 3, (12,))
    path = tmp_path / "mlp.pt"
    torch.save({"state_dict": source.backbone.state_dict()}, path)
    loaded = build_model({"name": "mlp", "hidden_dim": 8, "pretrained": str(path)}, 3, (12,))
    for a, b in zip(source.backbone.parameters(), loaded.backbone.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="does not fit"):
        build_model({"name": "mlp", "hidden_dim": 9, "pretrained": str(path)}, 3, (12,))


@pytest.mark.parametrize("name", ["mobilenetv3_small_050", "resnet18"])
def test_timm_head_takes_the_width_the_backbone_outputs(name):
    """The head's width is read from what the backbone outputs, not from timm's
    ``num_features``: MobileNetV3 pools 288 channels and then applies a 1024-wide pre-logits
    layer (``head_hidden_size``), so a head built on ``num_features`` fails in the first
    forward pass."""
    torch.manual_seed(0)
    model = build_model({"name": name}, 10, (3, 32, 32))
    x = torch.randn(2, 3, 32, 32)
    assert model.backbone(x).shape == (2, model.feature_dim)
    assert model(x).shape == (2, 10)
