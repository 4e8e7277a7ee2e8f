"""C0 parity of the sound decoder against diffusers' Cosmos3AVAEAudioTokenizer.decode (CPU fp32, tiny)."""

from __future__ import annotations

import pytest
import torch
from cosmos3_testutils import assert_close

from fv_cosmos3.models.audio_vae import Cosmos3AudioDecoder, Cosmos3AudioDecoderConfig

audio_module = pytest.importorskip("diffusers.models.autoencoders.autoencoder_cosmos3_audio")


def test_audio_decoder_matches_diffusers():
    config = Cosmos3AudioDecoderConfig.tiny()
    reference = audio_module.Cosmos3AVAEAudioTokenizer(
        vocoder_input_dim=4, dec_dim=4, dec_c_mults=(1, 2), dec_strides=(2, 3), dec_out_channels=2, encoder_enabled=False,
    ).eval()
    gen = torch.Generator().manual_seed(7)
    state = {k: 0.3 * torch.randn(v.shape, generator=gen) + (1.0 if k.endswith("weight_g") else 0.0)
             for k, v in reference.state_dict().items()}
    reference.load_state_dict(state, strict=True)
    ours = Cosmos3AudioDecoder(config).eval()
    ours.load_state_dict(state, strict=True)
    latents = torch.randn(4, 9, generator=gen)
    with torch.no_grad():
        expected = reference.decode(latents)
        actual = ours(latents)
    assert actual.shape == (2, 9 * config.hop) == expected.shape
    assert actual.abs().max() > 1e-3
    assert_close(actual, expected)
    assert Cosmos3AudioDecoderConfig.from_diffusers_config(dict(reference.config)) == config


def test_audio_decoder_rejects_wrong_channels():
    with pytest.raises(ValueError, match=r"\(B, 4, T\)"):
        Cosmos3AudioDecoder(Cosmos3AudioDecoderConfig.tiny())(torch.zeros(3, 5))
