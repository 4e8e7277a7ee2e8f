"""FastWan as its recipe made it: Video Sparse Attention with the checkpoint's compression gates.

The real card declares ``assumes_attention: vsa (0.8, 4x4x4)`` and a transformer with
``to_gate_compress``; a fastwan-shaped tiny card (fastwan-tiny with the gate and the VSA recipe)
runs end to end on CPU through the ``vsa`` driver and refuses dense attention with
``RecipeMismatch`` unless overridden, which the video's provenance then records.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fv_kernel.api import (
    AttentionAssumption,
    InstanceOptions,
    ModelCard,
    RecipeMismatch,
    Request,
    TaskType,
    TextPart,
    VideoSparseAttention,
    build_instance,
)
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_wan.cards import FASTWAN_VSA, wan_cards
from fv_wan.models.transformer import (
    WanConfigError,
    WanStateDictError,
    WanTransformer,
    WanTransformerConfig,
    load_wan_state_dict,
)

TINY_VSA = {"kind": "vsa", "sparsity": 0.75, "tile": (4, 4, 4)}


def card(model_id: str) -> ModelCard:
    return next(c for c in wan_cards() if c.model_id == model_id)


def fastwan_tiny_vsa() -> ModelCard:
    """fastwan-tiny with FastWan's shape of recipe: gated self-attention, trained under VSA."""
    data = card("fastwan-tiny").model_dump()
    data["model_id"] = "fastwan-tiny-vsa"
    data["components"]["transformer"]["config"]["has_gate_compress"] = True
    data["recipe"]["assumes_attention"] = TINY_VSA
    return ModelCard.model_validate(data)


def t2v(model: str) -> Request:
    # 9 frames at 128x128 -> a (3, 8, 8) token grid: 4 tiles of 4x4x4, one kept per query tile at 0.75.
    return Request(
        model=model, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox in snow"),),
        diffusion={"height": 128, "width": 128, "frames": 9, "seed": 7},
    )


def generate(instance: Any, request: Request) -> Any:
    engine = Engine(SchedulerConfig(device_thread=False))
    engine.add_instance(instance)
    return engine.generate(request).raise_for_status()


# --------------------------------------------------------------------------- the real card


def test_fastwan_card_declares_its_vsa_recipe_and_gates() -> None:
    fastwan = card("fastwan2.1-t2v-1.3b")
    assert fastwan.recipe.assumes_attention == AttentionAssumption(kind="vsa", sparsity=0.8, tile=(4, 4, 4)) == FASTWAN_VSA
    config = WanTransformerConfig.model_validate(fastwan.components["transformer"].config)
    assert config.has_gate_compress
    with torch.device("meta"):
        keys = set(WanTransformer(config).state_dict())
    assert {f"blocks.{i}.attn1.to_gate_compress.{p}" for i in range(30) for p in ("weight", "bias")} <= keys
    assert not any("attn2.to_gate_compress" in k for k in keys)  # self-attention only
    # Negative control: the base Wan 2.1 card has no gate and no attention assumption.
    base = card("wan2.1-t2v-1.3b")
    assert base.recipe.assumes_attention is None
    assert not WanTransformerConfig.model_validate(base.components["transformer"].config).has_gate_compress


def test_fastwan_with_dense_attention_is_a_recipe_mismatch() -> None:
    for backend in ("sdpa", "sdpa_math"):
        with pytest.raises(RecipeMismatch) as info:
            build_instance(card("fastwan2.1-t2v-1.3b"), InstanceOptions(attention_backend=backend))
        assert info.value.param == "attention_backend" and "vsa" in str(info.value)


def test_gate_weights_load_strictly() -> None:
    config = WanTransformerConfig.tiny().model_copy(update={"has_gate_compress": True})
    model = WanTransformer(config)
    state = model.state_dict()
    load_wan_state_dict(WanTransformer(config), state)  # complete: loads
    without_gates = {k: v for k, v in state.items() if "to_gate_compress" not in k}
    with pytest.raises(WanStateDictError, match="to_gate_compress"):
        load_wan_state_dict(WanTransformer(config), without_gates)
    # Negative control: an ungated model refuses the gate keys as unexpected.
    with pytest.raises(WanStateDictError, match="unexpected.*to_gate_compress"):
        load_wan_state_dict(WanTransformer(WanTransformerConfig.tiny()), state)


# --------------------------------------------------------------------------- the model wiring


def _tiny_inputs(config: WanTransformerConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, config.in_channels, 3, 16, 16, generator=gen)  # (3, 8, 8) tokens
    return latents, torch.tensor([500.0]), torch.randn(1, 6, config.text_dim, generator=gen)


def test_vsa_with_all_tiles_and_a_zero_gate_is_the_dense_model() -> None:
    """Ties the model's wiring (q/k/v layout, grid, gate heads) to the math: at sparsity 0 with the
    gate projection zeroed, VSA is exact dense attention, so the forward equals the dense forward."""
    torch.manual_seed(0)
    config = WanTransformerConfig.tiny().model_copy(update={"has_gate_compress": True})
    model = WanTransformer(config).eval()
    model.rope.build_tables()
    inputs = _tiny_inputs(config)
    with torch.no_grad():
        for block in model.blocks:
            block.attn1.to_gate_compress.weight.zero_()
            block.attn1.to_gate_compress.bias.zero_()
        dense = model(*inputs)
        model.set_video_attention(VideoSparseAttention(0.0, (4, 4, 4), "torch").attend_video)
        vsa = model(*inputs)
        torch.testing.assert_close(vsa, dense, atol=1e-5, rtol=1e-5)
        # Negative controls: a live gate adds the compressed branch; sparsity drops key tiles.
        for block in model.blocks:
            block.attn1.to_gate_compress.bias.fill_(1.0)
        assert (model(*inputs) - dense).abs().max() > 1e-3
        for block in model.blocks:
            block.attn1.to_gate_compress.bias.zero_()
        model.set_video_attention(VideoSparseAttention(0.75, (4, 4, 4), "torch").attend_video)
        assert (model(*inputs) - dense).abs().max() > 1e-3


def test_video_attention_needs_the_gate() -> None:
    model = WanTransformer(WanTransformerConfig.tiny())
    with pytest.raises(WanConfigError, match="has_gate_compress"):
        model.set_video_attention(VideoSparseAttention().attend_video)


# --------------------------------------------------------------------------- end to end


def test_fastwan_shaped_tiny_card_runs_end_to_end_with_vsa() -> None:
    tiny = fastwan_tiny_vsa()
    instance = build_instance(tiny, InstanceOptions(attention_backend="vsa"))
    result = generate(instance, t2v(tiny.model_id))
    video = result.artifact("video")
    assert video is not None and torch.isfinite(video.frames).all()
    assert video.provenance.recipe_overrides == ()
    transformer = instance.component("transformer")
    driver = transformer.video_attention.__self__  # the configured driver: the recipe's settings
    assert isinstance(driver, VideoSparseAttention) and (driver.sparsity, driver.tile) == (0.75, (4, 4, 4))
    assert transformer.attention_fn is torch.nn.functional.scaled_dot_product_attention  # cross-attention dense

    # Dense attention is refused; overridden, it runs, differs, and the video says so.
    with pytest.raises(RecipeMismatch) as info:
        build_instance(tiny)
    assert info.value.param == "attention_backend"
    dense = build_instance(tiny, InstanceOptions(attention_backend="sdpa", allow_recipe_mismatch=True))
    overridden = generate(dense, t2v(tiny.model_id)).artifact("video")
    assert overridden.provenance.recipe_overrides == ("attention_backend",)
    assert (overridden.frames - video.frames).abs().max() > 1e-4


def test_vsa_runs_in_the_fused_tier_as_in_eager() -> None:
    """The fused block path routes self-attention through the same driver with the same gate."""
    from fv_kernel.api import select_fused_ops

    torch.manual_seed(0)
    config = WanTransformerConfig.tiny().model_copy(update={"has_gate_compress": True})
    model = WanTransformer(config).eval()
    model.rope.build_tables()
    model.set_video_attention(VideoSparseAttention(0.75, (4, 4, 4), "torch").attend_video)
    inputs = _tiny_inputs(config)
    with torch.no_grad():
        eager = model(*inputs)
        model.set_fused_ops(select_fused_ops("cpu", "torch"))
        fused = model(*inputs)
        torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)
        # Negative control: the fused path without the driver (dense) is another output.
        model.set_video_attention(None)
        assert (model(*inputs) - eager).abs().max() > 1e-3
