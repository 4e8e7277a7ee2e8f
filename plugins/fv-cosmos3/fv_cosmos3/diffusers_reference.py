"""The reference side of the generator's parity tests and benchmark: diffusers' ``Cosmos3OmniTransformer``
fed exactly as ``Cosmos3OmniPipeline.__call__`` feeds it.

The packed inputs come from the pipeline's own segment builders (``_prepare_*_segment``), so
positions, FPS modulation, noisy-frame bookkeeping and modality order are the reference's, not
fv's. diffusers is imported when called (it is a test/benchmark dependency, not the plugin's).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from fv_cosmos3.models.config import Cosmos3Config

__all__ = ["diffusers_transformer", "diffusers_forward_kwargs"]


def diffusers_transformer(config: Cosmos3Config, state: dict[str, torch.Tensor], *, device: torch.device | str = "cpu",
                          dtype: torch.dtype = torch.float32, share: bool = False) -> torch.nn.Module:
    """diffusers' ``Cosmos3OmniTransformer`` of ``config`` holding ``state`` (fv's parameter names are diffusers').

    ``share``: the twin's parameters are ``state``'s tensors (no second copy of a real-size model);
    otherwise they are copied in.
    """
    import diffusers

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the twin in the weights' dtype: no fp32 copy of a real-size model
    try:
        with torch.device(device):
            model = diffusers.Cosmos3OmniTransformer(**config.to_diffusers_kwargs())
    finally:
        torch.set_default_dtype(previous)
    model.load_state_dict(state, strict=True, assign=share)
    return model.eval().requires_grad_(False)


def diffusers_forward_kwargs(
    model: torch.nn.Module,
    config: Cosmos3Config,
    input_ids: list[int],
    video: torch.Tensor,
    *,
    timestep: float,
    fps: float,
    video_condition_frames: list[int],
    sound: torch.Tensor | None = None,
    action: torch.Tensor | None = None,
    action_domain: int = 0,
    action_condition_frames: list[int] | None = None,
) -> dict[str, Any]:
    """The keyword arguments ``Cosmos3OmniPipeline.__call__`` passes the transformer for one item:
    ``input_ids`` the prompt, ``video`` (1, C, T, H, W) latents, ``sound`` (sound_dim, T), ``action`` (T, action_dim)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

    pipe = SimpleNamespace(transformer=SimpleNamespace(config=model.config),
                           vae_scale_factor_temporal=config.vae_temporal_compression)
    device = video.device
    text = Cosmos3OmniPipeline._prepare_text_segment(pipe, input_ids, device=device)
    offset = text["vision_start_temporal_offset"]
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        pipe, video, bool(video_condition_frames), offset, fps, text["und_len"], device,
        condition_frame_indexes=video_condition_frames,
    )
    curr = text["und_len"] + vision["num_vision_tokens"]
    sound_seg: dict[str, Any] = {}
    action_seg: dict[str, Any] = {}
    mrope = [text["text_mrope_ids"], vision["vision_mrope_ids"]]
    if sound is not None:
        sound_seg = Cosmos3OmniPipeline._prepare_sound_segment(pipe, sound, offset, config.sound_latent_fps, curr, device)
        curr += sound_seg["sound_len"]
        mrope.append(sound_seg["sound_mrope_ids"])
    if action is not None:
        action_seg = Cosmos3OmniPipeline._prepare_action_segment(
            pipe, action, action_condition_frames or [], offset, fps, curr, device
        )
        curr += action_seg["action_len"]
        mrope.append(action_seg["action_mrope_ids"])
    kwargs: dict[str, Any] = dict(
        input_ids=text["input_ids"],
        text_indexes=text["text_indexes"],
        position_ids=torch.cat(mrope, dim=1),
        und_len=text["und_len"],
        sequence_length=curr,
        vision_tokens=[video],
        vision_token_shapes=vision["vision_token_shapes"],
        vision_sequence_indexes=vision["vision_sequence_indexes"],
        vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
        vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), timestep, device=device),
        vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"],
        return_dict=False,
    )
    if sound is not None:
        kwargs.update(
            sound_tokens=[sound],
            sound_token_shapes=sound_seg["sound_token_shapes"],
            sound_sequence_indexes=sound_seg["sound_sequence_indexes"],
            sound_mse_loss_indexes=sound_seg["sound_mse_loss_indexes"],
            sound_timesteps=torch.full((sound_seg["sound_len"],), timestep, device=device),
            sound_noisy_frame_indexes=sound_seg["sound_noisy_frame_indexes"],
        )
    if action is not None:
        kwargs.update(
            action_tokens=[action],
            action_token_shapes=action_seg["action_token_shapes"],
            action_sequence_indexes=action_seg["action_sequence_indexes"],
            action_mse_loss_indexes=action_seg["action_mse_loss_indexes"],
            action_timesteps=torch.full((action_seg["num_noisy_action_tokens"],), timestep, device=device),
            action_noisy_frame_indexes=action_seg["action_noisy_frame_indexes"],
            action_domain_ids=[torch.tensor([action_domain], device=device)],
        )
    return kwargs
