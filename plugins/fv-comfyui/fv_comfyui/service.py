"""One answer for a prompt, as ComfyUI's ``POST /prompt`` gives it: validate, then compile.

:meth:`ComfyService.check` runs ComfyUI's validation (:mod:`fv_comfyui.validate`) and then
the compiler (:mod:`fv_comfyui.compile`) over the outputs that passed. An output the
compiler refuses is answered like one validation refused: a node error naming the node, and
the prompt is accepted only if at least one output is left (HTTP 200 with ``node_errors``),
else ``prompt_outputs_failed_validation`` (HTTP 400). Nothing is computed before this answer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from fv_kernel.api import CardCatalog, FvError, ModelCard, RequestLimits, resolve_request
from fv_comfyui.compile import ComfyJob, WeightFiles, compile_prompt
from fv_comfyui.convert import is_ui_workflow, ui_to_api
from fv_comfyui.loras import LoraFolder, LoraLibrary
from fv_comfyui.models import ModelMap
from fv_comfyui.paths import inside
from fv_comfyui.validate import ValidationContext, validate_prompt

__all__ = ["PromptAnswer", "ComfyService", "service_for"]


@dataclass
class PromptAnswer:
    """The verdict on one prompt: ``status`` and ``body`` as ``POST /prompt`` answers, and the jobs to run."""

    ok: bool
    status: int
    error: dict[str, Any] | None
    node_errors: dict[str, Any]
    prompt: dict[str, Any]
    jobs: list[ComfyJob] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        return {"error": self.error, "node_errors": self.node_errors}


@dataclass
class ComfyService:
    """The model mapping, the installed cards and the input folder a prompt is checked against."""

    models: ModelMap
    cards: Mapping[str, ModelCard]
    input_dir: Path
    #: The sampler names the deployment registers (its registry's ``sampler_names()``).
    sampler_names: tuple[str, ...] = ()
    limits: RequestLimits = field(default_factory=RequestLimits)
    #: The LoRA folder (``lora_name``'s list) and its files converted for the cards.
    loras: LoraLibrary = field(default_factory=lambda: LoraLibrary(None))
    #: Cards run with adapters disabled (the deploy config has no ``adapters:`` section); a LoRA node on
    #: them is refused at compile.
    adapters_off: frozenset[str] = frozenset()
    #: Card -> the precision path its served instance runs (``fv serve``); None: each job loads its card at the
    #: path its ``weight_dtype`` asks (``fv comfy run``).
    served_paths: Mapping[str, str] | None = None
    #: Where UNETLoader files are read from (ComfyUI's diffusion_models folder; the files a server serves).
    weight_files: WeightFiles = field(default_factory=WeightFiles)

    def image_path(self, name: str) -> Path | None:
        """``LoadImage``'s file, ``name`` or ``subfolder/name`` inside the input folder (never outside it)."""
        if not name:
            return None
        path = inside(self.input_dir, name)
        return path if path is not None and path.is_file() else None

    def image_size(self, name: str) -> tuple[int, int] | None:
        path = self.image_path(name)
        if path is None:
            return None
        from PIL import Image

        with Image.open(path) as image:
            return image.size

    def validation_context(self) -> ValidationContext:
        return ValidationContext(
            folders={**self.models.folders(), "loras": self.loras.names(), "input": self.input_files()},
            image_exists=lambda name: self.image_path(name) is not None,
        )

    def input_files(self) -> list[str]:
        if not self.input_dir.is_dir():
            return []
        return sorted(p.name for p in self.input_dir.iterdir() if p.is_file())

    def load_image(self, name: str) -> torch.Tensor | None:
        """``LoadImage``'s file as (3, H, W) in [0, 1], read as ``fv generate --image`` reads it."""
        path = self.image_path(name)
        if path is None:
            return None
        from PIL import Image

        with Image.open(path) as image:
            rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
        return torch.from_numpy(rgb).permute(2, 0, 1).contiguous()

    def _check_request(self, job: ComfyJob) -> str | None:
        """The card's own request checks (sizes, frame rule, limits), before anything runs; None when it passes."""
        image = self.load_image(job.image_name) if job.image_name is not None else None
        try:
            resolve_request(job.card, job.request(image), self.limits, samplers=self.sampler_names)
        except FvError as exc:
            return exc.message
        except ValueError as exc:  # the request's own pydantic checks
            return " ".join(str(exc).split())
        return None

    def check(self, document: Any, partial_execution_targets: list[str] | None = None) -> PromptAnswer:
        """Validate and compile ``document`` (an API prompt, or a UI workflow converted first)."""
        prompt = ui_to_api(document) if is_ui_workflow(document) else copy.deepcopy(document)
        result = validate_prompt(prompt, self.validation_context(), partial_execution_targets)
        if not result.ok:
            return PromptAnswer(False, 400, result.error, result.node_errors, prompt if isinstance(prompt, dict) else {})
        compiled = compile_prompt(
            prompt, result.good_outputs, models=self.models, cards=self.cards, image_size=self.image_size,
            loras=self.loras, adapters_off=self.adapters_off, served_paths=self.served_paths,
            weight_files=self.weight_files,
        )
        node_errors = dict(result.node_errors)
        for node_id, entry in compiled.node_errors.items():
            if node_id in node_errors:
                node_errors[node_id]["errors"].extend(entry["errors"])
                node_errors[node_id]["dependent_outputs"].extend(entry["dependent_outputs"])
            else:
                node_errors[node_id] = entry
        for job in list(compiled.jobs):
            problem = self._check_request(job)
            if problem is not None:
                compiled.jobs.remove(job)
                node_errors[job.sampler_node] = {
                    "errors": [{"type": "custom_validation_failed", "message": "Custom validation failed for node",
                                "details": f"fv: {problem}", "extra_info": {}}],
                    "dependent_outputs": [t.node_id for t in job.outputs],
                    "class_type": prompt[job.sampler_node]["class_type"],
                }
                compiled.node_errors[job.sampler_node] = node_errors[job.sampler_node]
        if not compiled.jobs:
            details = "\n".join(
                f"{e['message']}: {e['details']}" for entry in compiled.node_errors.values() for e in entry["errors"]
            )
            error = {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation",
                     "details": details, "extra_info": {}}
            return PromptAnswer(False, 400, error, node_errors, prompt)
        return PromptAnswer(True, 200, None, node_errors, prompt, compiled.jobs)


def service_for(
    host: Any,
    models: ModelMap,
    input_dir: Path,
    *,
    limits: RequestLimits | None = None,
    cards: set[str] | None = None,
    loras: Path | None = None,
    adapters: bool = True,
    diffusion_models: Path | None = None,
) -> ComfyService:
    """A service over ``host``'s installed cards (or only ``cards``: what a server serves); ``loras``:
    ComfyUI's ``models/loras`` folder; ``adapters``: whether the deployment has adapters on;
    ``diffusion_models``: ComfyUI's ``models/diffusion_models`` folder (UNETLoader files load from it)."""
    entries = CardCatalog(host).entries()
    installed = {card_id: entry.card for card_id, entry in entries.items() if cards is None or card_id in cards}
    models.check_cards(set(entries))
    return ComfyService(
        models=models, cards=installed, input_dir=input_dir,
        sampler_names=tuple(host.registry().sampler_names()), limits=limits or RequestLimits(),
        loras=LoraLibrary(LoraFolder(loras) if loras is not None else None),
        adapters_off=frozenset() if adapters else frozenset(installed),
        weight_files=WeightFiles(diffusion_models=diffusion_models),
    )
