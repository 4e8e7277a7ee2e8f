"""Named-driver registries, the built-in sdpa attention and in-process transport drivers."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from fv_kernel.compute.attention import AttentionBackend, AttentionShapeError, SDPAAttention
from fv_kernel.plugins import DriverRegistry, DriverTypeError, DuplicateContributionError, PluginHost, PluginsConfig, UnknownDriverError
from fv_kernel.transport import Transport, TransportError
from fv_kernel.transport.inproc import InProcessTransport


def fixture_host(site: Path, **config: object) -> PluginHost:
    host = PluginHost(PluginsConfig(**config), search_path=[str(site)], environ={})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        host.start()
    return host


def test_driver_lookup_imports_only_the_selected_driver(plugin_site: Path) -> None:
    registry = fixture_host(plugin_site, disable=["fv-bad"]).drivers("attention_backends")
    assert {"toy", "hello-math", "sdpa"} <= set(registry.names()) and "not-a-backend" not in registry.names()
    assert "fv_good.attention" not in sys.modules
    toy = registry.load("toy")
    assert toy.__module__ == "fv_good.attention" and issubclass(toy, AttentionBackend)
    assert "fv_good.transport" not in sys.modules and "fv_good.plugin" in sys.modules


def test_driver_base_class_is_checked(plugin_site: Path) -> None:
    registry = fixture_host(plugin_site).drivers("attention_backends")
    with pytest.raises(DriverTypeError) as info:
        registry.load("not-a-backend")
    message = str(info.value)
    assert "fv.attention_backends: not-a-backend = fv_bad.attention:NotABackend (from fv-bad)" in message
    assert "must be a subclass of fv_kernel.compute.attention:AttentionBackend, got NotABackend" in message


def test_unknown_driver_lists_available_and_why_missing(plugin_site: Path) -> None:
    registry = fixture_host(plugin_site, autoload=False).drivers("transports")
    assert registry.names() == ["inproc"]  # the kernel's built-in is always on
    with pytest.raises(UnknownDriverError, match=r"no transports driver named 'loopback'.*available: inproc.*'fv-good' is not an enabled fv plugin"):
        registry.load("loopback")


def test_ambiguous_driver_names_need_a_namespaced_id(plugin_site: Path) -> None:
    import importlib.metadata as md

    eps = [md.EntryPoint("x", "fv_kernel.compute.attention:SDPAAttention", "fv.attention_backends")] * 2
    with pytest.raises(DuplicateContributionError, match="'x' is ambiguous"):
        DriverRegistry("attention_backends", eps).load("x")


def test_builtins_come_from_the_kernels_own_entry_points() -> None:
    host = PluginHost(PluginsConfig(autoload=False), environ={})
    host.start()
    assert host.drivers("attention_backends").load("sdpa") is SDPAAttention
    assert host.drivers("transports").load("fv-kernel/inproc") is InProcessTransport
    assert {"fv-kernel/euler", "fv-kernel/unipc", "fv-kernel/dmd"} <= set(host.hooks.samplers())


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_sdpa_matches_softmax_attention_with_gqa_and_mask() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8)
    k, v = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True
    out = SDPAAttention().attend(q, k, v, attn_mask=mask)
    expected = reference_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(AttentionShapeError, match="multiple of k/v heads"):
        SDPAAttention().attend(torch.randn(1, 3, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))


def test_inproc_transport_roundtrip_and_errors() -> None:
    transport: Transport = InProcessTransport()
    latent = torch.arange(6.0).reshape(2, 3)
    manifest = transport.publish("t1", {"latent": latent})
    assert manifest.tensors["latent"].shape == (2, 3) and manifest.tensors["latent"].dtype == "float32"
    assert transport.fetch(manifest)["latent"] is latent  # zero-copy reference semantics
    with pytest.raises(TransportError, match="already published"):
        transport.publish("t1", {})
    transport.release(manifest)
    with pytest.raises(TransportError, match="unknown or already released"):
        transport.fetch(manifest)
    forged = manifest.model_copy(update={"transfer_id": "t2"})
    transport.publish("t2", {"latent": latent.half()})
    with pytest.raises(TransportError, match="tensor 'latent' is"):
        transport.fetch(forged)
