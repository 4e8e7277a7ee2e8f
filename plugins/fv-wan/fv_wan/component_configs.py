"""The configs of fv-wan's encoder components, as cards declare them.

A card names these through ``ComponentSpec.config_schema``; ``fv cards validate`` and the
loaders in :mod:`fv_wan.instance` parse the component's ``config`` with them. (The
transformer and VAE parse through ``WanTransformerConfig`` / ``WanVAEConfig``.)
Import-light: pydantic only, so validating a card does not import torch here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PositiveInt

__all__ = ["TinyTextEncoder", "TinyImageEncoder", "WanTextEncoderConfig", "WanImageEncoderConfig"]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyTextEncoder(_Config):
    """A seeded random UMT5 over the byte tokenizer (``WanTextEncoder.tiny``)."""

    d_model: PositiveInt = 32
    num_layers: PositiveInt = 2


class WanTextEncoderConfig(_Config):
    """The ``text_encoder`` component: UMT5 (+ tokenizer) from the checkpoint, or a seeded tiny one."""

    #: Embedded cards: the seeded tiny encoder's size (used when the card has no checkpoint source).
    tiny: TinyTextEncoder | None = None
    #: The hidden width the checkpoint's encoder must have (the transformer's ``text_dim``);
    #: checked when it loads. None: not checked.
    d_model: PositiveInt | None = None


class TinyImageEncoder(_Config):
    """A seeded random CLIP vision tower (``WanImageEncoder.tiny``)."""

    hidden_size: PositiveInt = 16
    image_size: PositiveInt = 32
    patch_size: PositiveInt = 8


class WanImageEncoderConfig(_Config):
    """The ``image_encoder`` component: CLIP vision (+ image processor) from the checkpoint, or a seeded tiny one."""

    tiny: TinyImageEncoder | None = None
    #: The hidden width the checkpoint's tower must have (the transformer's ``image_dim``); None: not checked.
    hidden_size: PositiveInt | None = None
