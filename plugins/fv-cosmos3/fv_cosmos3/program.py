"""The omni program: upsample the prompt with the reasoner, generate, then fan out the decoders.

Every loop runs on the one resident instance passed in, so the reasoner weights that
decode the upsampled prompt are the weights whose K/V conditions the generator. Each
loop's steps go through ``ctx.execute`` and are interleaved by the scheduler with
other requests' steps. Every loop runs through ``run_loop`` and the control flow reads
only the request and loop results, so the program resumes from a checkpoint.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fv_kernel.api import Artifact, LoopContext, ModelInstance, Program, Request, TaskType

__all__ = ["Cosmos3Program"]


class Cosmos3Program(Program):
    """``[ar_decode] -> denoise -> (decode_video || decode_sound)``, or ``ar_decode`` alone for text."""

    resumable = True

    def _denoise_loop(self, request: Request) -> str:
        from fv_kernel.api import select_denoise_loop

        return select_denoise_loop(self.card, request) or "denoise"

    def loop_ids(self, request: Request) -> list[str]:
        if request.task is TaskType.TEXT_GENERATION:
            return ["ar_decode"]
        loops = (["ar_decode"] if request.prompt_upsampling else []) + [self._denoise_loop(request), "decode_video"]
        if request.task is TaskType.TEXT_TO_VIDEO_AUDIO:
            loops.append("decode_sound")
        return loops

    async def run(self, model: ModelInstance, ctx: LoopContext) -> list[Artifact]:
        request = ctx.request
        pool = getattr(model, "text_kv_pool", None)
        artifacts: list[Any] = []
        upstream: dict[str, Any] = {}
        try:
            if request.task is TaskType.TEXT_GENERATION:
                result = await self.run_loop("ar_decode", model, ctx.child({"ar_purpose": "chat"}))
                return list(result.artifacts)
            if request.prompt_upsampling:
                result = await self.run_loop("ar_decode", model, ctx.child({"ar_purpose": "upsample"}))
                artifacts.extend(result.artifacts)  # the TextArtifact "upsampled_prompt"
                upstream["upsampled_prompt"] = result.outputs["upsampled_prompt"]
                if pool is not None:
                    pool.free_owner(request.request_id)  # the reasoner's blocks are not needed past this point
            denoised = await self.run_loop(self._denoise_loop(request), model, ctx.child(upstream))
            artifacts.extend(denoised.artifacts)
            upstream.update(denoised.outputs)
            decoders = ["decode_video"] + (["decode_sound"] if "sound_latents" in upstream else [])
            # Fan-out: both decoders' steps are in flight together.
            results = await asyncio.gather(*(self.run_loop(l, model, ctx.child(upstream)) for l in decoders))
            for decoded in results:
                artifacts.extend(decoded.artifacts)
            return artifacts
        finally:
            if pool is not None:
                pool.free_owner(request.request_id)  # also on failure and cancellation
