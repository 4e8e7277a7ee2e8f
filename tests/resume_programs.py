"""A custom program for the resume tests: it drives its loops itself and does not declare
``resumable``, so nothing records its loops and a started request of it cannot continue."""

from __future__ import annotations

from typing import Any

from fv_kernel.loop.driver import drive
from fv_kernel.program.base import Program
from fv_kernel.request.request import Request


class DrivesItsLoopsItself(Program):
    def loop_ids(self, request: Request) -> list[str]:
        return ["text_encode", "denoise", "decode"]

    async def run(self, model: Any, ctx: Any) -> list[Any]:
        upstream: dict[str, Any] = {}
        artifacts: list[Any] = []
        for loop_id in self.loop_ids(ctx.request):
            result = await drive(model.loop(loop_id), model, ctx.child(upstream))
            upstream.update(result.outputs)
            artifacts.extend(result.artifacts)
        return artifacts
