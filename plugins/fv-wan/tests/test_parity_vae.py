"""C0 parity of fv_wan's Wan VAEs against diffusers' AutoencoderKLWan (CPU, fp32, tiny seeded configs).

Both models get the same state dict (loaded into ours with strict=True); every
comparison is max-abs-diff <= 1e-5.
"""

from __future__ import annotations

import io

import pytest
import safetensors.torch
import torch

from fv_wan.models.vae import CausalCache, TilingConfig, WanVAE, WanVAEConfig

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKLWan  # noqa: E402
from tiny_vae_configs import CFG21, CFG22  # noqa: E402

ATOL = 1e-5



def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _pair(cfg: WanVAEConfig) -> tuple[AutoencoderKLWan, WanVAE]:
    torch.manual_seed(0)
    reference = AutoencoderKLWan(**cfg.to_diffusers_config()).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms and biases (defaults are ones/zeros)
        for name, param in reference.named_parameters():
            if name.endswith("gamma"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    ours = WanVAE(cfg).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


@pytest.fixture(scope="module")
def pair21() -> tuple[AutoencoderKLWan, WanVAE]:
    return _pair(CFG21)


@pytest.fixture(scope="module")
def pair22() -> tuple[AutoencoderKLWan, WanVAE]:
    return _pair(CFG22)


def _video(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _latents(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _reference_encode(reference: AutoencoderKLWan, video: torch.Tensor, tiling: TilingConfig | None = None):
    if tiling is None:
        reference.disable_tiling()
    else:
        reference.enable_tiling(**tiling.model_dump())
    try:
        return reference.encode(video).latent_dist
    finally:
        reference.disable_tiling()


def _reference_decode(reference: AutoencoderKLWan, z: torch.Tensor, tiling: TilingConfig | None = None):
    if tiling is None:
        reference.disable_tiling()
    else:
        reference.enable_tiling(**tiling.model_dump())
    try:
        return reference.decode(z).sample
    finally:
        reference.disable_tiling()


TILES21 = TilingConfig(
    tile_sample_min_height=24, tile_sample_min_width=24, tile_sample_stride_height=16, tile_sample_stride_width=16
)
TILES22 = TilingConfig(
    tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16, tile_sample_stride_width=16
)


# ----------------------------------------------------------------- structure


@pytest.mark.parametrize("preset", [WanVAEConfig.wan21, WanVAEConfig.wan22])
def test_real_presets_have_diffusers_state_dict(preset) -> None:
    cfg = preset()
    with torch.device("meta"):
        reference = AutoencoderKLWan(**cfg.to_diffusers_config())
        ours = WanVAE(cfg)
    ref_shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    our_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert our_shapes == ref_shapes
    assert len(cfg.latents_mean) == len(cfg.latents_std) == cfg.z_dim


# ------------------------------------------------------------------ Wan 2.1


def test_wan21_encode(pair21) -> None:
    reference, ours = pair21
    video = _video((2, 3, 9, 32, 40), seed=2)
    with torch.no_grad():
        posterior = _reference_encode(reference, video)
        mean, logvar = ours.encode(video)
    assert mean.shape == (2, 4, 3, 4, 5)
    assert _max_diff(mean, posterior.mean) <= ATOL
    assert _max_diff(logvar, posterior.logvar) <= ATOL


def test_wan21_decode(pair21) -> None:
    reference, ours = pair21
    z = _latents((2, 4, 3, 4, 5), seed=3)
    with torch.no_grad():
        expected = _reference_decode(reference, z)
        got = ours.decode(z)
    assert got.shape == (2, 3, 9, 32, 40)
    assert _max_diff(got, expected) <= ATOL


def test_wan21_tiled_decode(pair21) -> None:
    reference, ours = pair21
    z = _latents((1, 4, 2, 5, 6), seed=4)
    with torch.no_grad():
        expected = _reference_decode(reference, z, TILES21)
        got = ours.decode(z, tiling=TILES21)
        untiled = ours.decode(z)
    assert _max_diff(got, expected) <= ATOL
    assert _max_diff(got, untiled) > 1e-3  # tiling really happened


def test_wan21_tiled_encode(pair21) -> None:
    reference, ours = pair21
    video = _video((1, 3, 5, 40, 48), seed=5)
    with torch.no_grad():
        posterior = _reference_encode(reference, video, TILES21)
        mean, logvar = ours.encode(video, tiling=TILES21)
        untiled_mean, _ = ours.encode(video)
    assert _max_diff(mean, posterior.mean) <= ATOL
    assert _max_diff(logvar, posterior.logvar) <= ATOL
    assert _max_diff(mean, untiled_mean) > 1e-3


def test_wan21_sampled_latent_matches_diffusers_posterior_sample(pair21) -> None:
    reference, ours = pair21
    video = _video((1, 3, 5, 16, 16), seed=6)
    with torch.no_grad():
        expected = _reference_encode(reference, video).sample(generator=torch.Generator().manual_seed(7))
        got = ours.encode_latent(video, sample=True, generator=torch.Generator().manual_seed(7))
        mode = ours.encode_latent(video)
    assert _max_diff(got, expected) <= ATOL
    assert _max_diff(got, mode) > 1e-3


# ------------------------------------------------------------------ Wan 2.2


def test_wan22_encode_decode(pair22) -> None:
    reference, ours = pair22
    video = _video((1, 3, 5, 32, 48), seed=8)
    z = _latents((1, 8, 3, 2, 3), seed=9)
    with torch.no_grad():
        posterior = _reference_encode(reference, video)
        mean, logvar = ours.encode(video)
        expected = _reference_decode(reference, z)
        got = ours.decode(z)
    assert mean.shape == (1, 8, 2, 2, 3)
    assert _max_diff(mean, posterior.mean) <= ATOL
    assert _max_diff(logvar, posterior.logvar) <= ATOL
    assert got.shape == (1, 3, 9, 32, 48)
    assert _max_diff(got, expected) <= ATOL


def test_wan22_tiled_decode_and_encode(pair22) -> None:
    reference, ours = pair22
    z = _latents((1, 8, 2, 3, 4), seed=10)
    video = _video((1, 3, 5, 64, 48), seed=11)
    with torch.no_grad():
        expected = _reference_decode(reference, z, TILES22)
        got = ours.decode(z, tiling=TILES22)
        posterior = _reference_encode(reference, video, TILES22)
        mean, logvar = ours.encode(video, tiling=TILES22)
        untiled = ours.decode(z)
    assert _max_diff(got, expected) <= ATOL
    assert _max_diff(got, untiled) > 1e-3
    assert _max_diff(mean, posterior.mean) <= ATOL
    assert _max_diff(logvar, posterior.logvar) <= ATOL


# ---------------------------------------------------- streaming and the cache


def test_decode_step_streaming_equals_decode(pair21) -> None:
    _, ours = pair21
    z = _latents((1, 4, 4, 4, 5), seed=12)
    with torch.no_grad():
        full = ours.decode(z)
        cache = ours.new_decode_cache()
        chunks = []
        for k in range(z.shape[2]):
            frames, cache = ours.decode_step(z[:, :, k : k + 1], cache)
            chunks.append(frames)
    assert [c.shape[2] for c in chunks] == [1, 4, 4, 4]
    assert cache.steps_done == 4
    assert torch.equal(torch.cat(chunks, dim=2), full)
    with torch.no_grad():
        assert torch.equal(torch.cat(list(ours.iter_decode(z)), dim=2), full)


def test_tiled_decode_step_streaming_equals_tiled_decode(pair22) -> None:
    _, ours = pair22
    z = _latents((1, 8, 3, 3, 4), seed=13)
    with torch.no_grad():
        full = ours.decode(z, tiling=TILES22)
        cache = ours.new_decode_cache()
        chunks = []
        for k in range(z.shape[2]):
            frames, cache = ours.decode_step(z[:, :, k : k + 1], cache, tiling=TILES22)
            chunks.append(frames)
    assert len(cache.tiles) == 12  # 3 x 4 latent tiles, one history each
    assert _max_diff(torch.cat(chunks, dim=2), full) <= 1e-6


def test_cache_serialized_mid_decode_resumes_identically(pair22) -> None:
    _, ours = pair22
    z = _latents((1, 8, 4, 2, 3), seed=14)
    with torch.no_grad():
        full = ours.decode(z)
        cache = ours.new_decode_cache()
        head = [ours.decode_step(z[:, :, k : k + 1], cache)[0] for k in range(2)]
        blob = safetensors.torch.save(cache.to_tensors())
        buffer = io.BytesIO()
        torch.save(cache.to_tensors(), buffer)
        del cache
        restored = CausalCache.from_tensors(safetensors.torch.load(blob))
        restored_pt = CausalCache.from_tensors(torch.load(io.BytesIO(buffer.getvalue())))
        assert restored.steps_done == 2
        tail = [ours.decode_step(z[:, :, k : k + 1], restored)[0] for k in range(2, 4)]
        tail_pt = [ours.decode_step(z[:, :, k : k + 1], restored_pt)[0] for k in range(2, 4)]
    assert torch.equal(torch.cat(head + tail, dim=2), full)
    assert torch.equal(torch.cat(head + tail_pt, dim=2), full)


def test_two_interleaved_streams_do_not_share_state(pair21) -> None:
    _, ours = pair21
    za, zb = _latents((1, 4, 3, 4, 5), seed=15), _latents((1, 4, 3, 4, 5), seed=16)
    with torch.no_grad():
        expected_a, expected_b = ours.decode(za), ours.decode(zb)
        cache_a, cache_b = ours.new_decode_cache(), ours.new_decode_cache()
        out_a, out_b = [], []
        for k in range(3):
            out_a.append(ours.decode_step(za[:, :, k : k + 1], cache_a)[0])
            out_b.append(ours.decode_step(zb[:, :, k : k + 1], cache_b)[0])
    assert torch.equal(torch.cat(out_a, dim=2), expected_a)
    assert torch.equal(torch.cat(out_b, dim=2), expected_b)


def test_cache_rejects_changed_tiling_mid_stream(pair22) -> None:
    _, ours = pair22
    z = _latents((1, 8, 2, 3, 4), seed=17)
    with torch.no_grad():
        cache = ours.new_decode_cache()
        _, cache = ours.decode_step(z[:, :, :1], cache, tiling=TILES22)
        with pytest.raises(ValueError, match="tile"):
            ours.decode_step(z[:, :, 1:2], cache)


def test_cache_from_tensors_rejects_bad_keys() -> None:
    tensors = CausalCache(tiles=[[None, torch.zeros(1)]], steps_done=1).to_tensors()
    assert CausalCache.from_tensors(tensors).tiles[0][1] is not None
    with pytest.raises(ValueError, match="outside"):
        CausalCache.from_tensors({**tensors, "tile3.slot0": torch.zeros(1)})
    with pytest.raises(ValueError, match="meta.steps_done"):
        CausalCache.from_tensors({k: v for k, v in tensors.items() if k != "meta.steps_done"})


# ---------------------------------------------------------------- the rest


def test_slicing_equals_no_slicing(pair21) -> None:
    _, ours = pair21
    video = _video((2, 3, 5, 16, 24), seed=18)
    z = _latents((2, 4, 2, 2, 3), seed=19)
    with torch.no_grad():
        mean, logvar = ours.encode(video)
        mean_s, logvar_s = ours.encode(video, slicing=True)
        decoded, decoded_s = ours.decode(z), ours.decode(z, slicing=True)
    # Batch size changes the CPU conv algorithm, so equality is up to fp32 rounding.
    assert _max_diff(mean, mean_s) <= ATOL and _max_diff(logvar, logvar_s) <= ATOL
    assert _max_diff(decoded, decoded_s) <= ATOL


def test_latent_normalisation(pair22) -> None:
    _, ours = pair22
    z = _latents((2, 8, 3, 2, 2), seed=20)
    normalized = ours.normalize_latents(z)
    mean = torch.tensor(CFG22.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(CFG22.latents_std).view(1, -1, 1, 1, 1)
    assert _max_diff(normalized, (z - mean) / std) <= 1e-6
    assert _max_diff(ours.denormalize_latents(normalized), z) <= 1e-6
    with pytest.raises(ValueError, match="z must be"):
        ours.normalize_latents(z[:, :4])


def test_config_from_diffusers_config() -> None:
    raw = {"_class_name": "AutoencoderKLWan", "_diffusers_version": "0.35.0", **CFG22.to_diffusers_config()}
    assert WanVAEConfig.from_diffusers_config(raw) == CFG22
    with pytest.raises(ValueError, match=r"Unknown Wan VAE config keys \['bogus_key'\]"):
        WanVAEConfig.from_diffusers_config({**raw, "bogus_key": 1})
    with pytest.raises(ValueError, match="latents_mean needs z_dim"):
        WanVAEConfig.from_diffusers_config({**raw, "latents_mean": [0.0] * 16})
    with pytest.raises(ValueError, match="scale_factor_spatial"):
        WanVAEConfig.from_diffusers_config({**raw, "scale_factor_spatial": 8})
    with pytest.raises(ValueError):
        WanVAEConfig(z_dim=4, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4, unknown=1)


def test_bad_inputs_raise_clear_errors(pair21) -> None:
    _, ours = pair21
    with torch.no_grad():
        with pytest.raises(ValueError, match="frames must be 1 \\+ 4k"):
            ours.encode(_video((1, 3, 4, 16, 16), seed=0))
        with pytest.raises(ValueError, match="multiples of 8"):
            ours.encode(_video((1, 3, 5, 12, 16), seed=0))
        with pytest.raises(ValueError, match="exactly one latent frame"):
            ours.decode_step(_latents((1, 4, 2, 2, 2), seed=0), ours.new_decode_cache())
    with pytest.raises(ValueError, match="must be <="):
        TilingConfig(tile_sample_stride_height=300)
    with pytest.raises(ValueError, match="multiple of 8"):
        ours.decode(_latents((1, 4, 1, 4, 4), seed=0), tiling=TilingConfig(
            tile_sample_min_height=20, tile_sample_min_width=20, tile_sample_stride_height=12, tile_sample_stride_width=12
        ))  # fmt: skip
