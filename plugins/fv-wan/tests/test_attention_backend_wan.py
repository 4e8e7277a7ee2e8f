"""fv-wan applies the deployment's attention backend and compute tier to its transformer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

def test_wan_instance_applies_backend_and_compute_tier() -> None:
    from fv_kernel.model.options import InstanceOptions
    from fv_kernel.compute.compile import ComputeOptions
    from fv_kernel.compute.fused import TorchFusedOps
    from fv_wan.cards import wan_cards
    from fv_wan.instance import build_wan_instance

    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    g = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(2, 16, 3, 8, 6, generator=g), "t": torch.tensor([900.0, 20.0]),
              "context": torch.randn(2, 10, 32, generator=g)}
    default = build_wan_instance(card, InstanceOptions())
    default.component("transformer")
    assert default.components["transformer"].attention_fn is F.scaled_dot_product_attention
    tuned = build_wan_instance(card, InstanceOptions(attention_backend="sdpa_math"), ComputeOptions(fused_ops="torch"))
    model = tuned.component("transformer")
    assert isinstance(model.fused_ops, TorchFusedOps) and model.attention_fn.__self__.name == "sdpa_math"
    with torch.no_grad():
        want = default.op("dit_forward:transformer").fn(inputs, {})["v"]
        got = tuned.op("dit_forward:transformer").fn(inputs, {})["v"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
