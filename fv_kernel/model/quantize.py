"""``fv quantize``: write a card's fp8 weights once, as a card that loads them as they are.

:func:`quantize_card` builds the card's instance on an fp8 linear path (its family quantizes
the ``fp8_targets`` at load), then writes each quantized component's state dict (e4m3
``weight`` + fp32 ``weight_scale`` for the targets, everything else as loaded) as safetensors
in the component's checkpoint folder, beside a copy of the source's other files and folders (a
tokenizer, a scheduler config; a seeded
component's folder gets the card's component config as ``config.json``), and a card
(``fv-card.json``) whose ``recipe.quantized_from`` records the card, weights version and path.
Loading that folder back quantizes nothing and runs bit-identically to quantizing at load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torch import nn

from fv_kernel import __version__
from fv_kernel.card.checkpoint import resolve_source
from fv_kernel.card.spec import ModelCard, QuantizedFrom
from fv_kernel.compute.fp8 import Fp8Linear
from fv_kernel.errors import FvError, InvalidRequest
from fv_kernel.model.catalog import CARD_FILE
from fv_kernel.model.instance import build_instance
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.precision import apply_precision_path

__all__ = ["QUANTIZE_PATHS", "QuantizeError", "quantize_card"]

#: The paths ``fv quantize`` writes weights for (both store per-channel e4m3 weights; they differ
#: in what the served card does with activations).
QUANTIZE_PATHS = ("fp8_weights", "fp8_dynamic")
_WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


class QuantizeError(FvError):
    """``fv quantize`` cannot write the output it was asked for."""

    error_type = "quantize"


def quantize_card(card: ModelCard, options: InstanceOptions, path: str, output: Path, *,
                  model_id: str | None = None) -> ModelCard:
    """Write ``card`` quantized for ``path`` to the new folder ``output``; return the card serving it.

    ``options`` build the source instance (device, precision, checkpoint source). ``model_id``:
    the new card's id (default ``<card>-<path>``). Typed errors, before anything is written: a
    path other than :data:`QUANTIZE_PATHS` or one the card does not list (``precision_path``), a
    card with no ``fp8_targets`` or already quantized (``model``), an ``output`` that exists.
    """
    if path not in QUANTIZE_PATHS:
        raise InvalidRequest("precision_path", f"fv quantize writes fp8 weights; {path!r} has none to write",
                             allowed=QUANTIZE_PATHS)
    listed = [p for p in QUANTIZE_PATHS if p in card.precision.paths]
    if path not in card.precision.paths:
        raise InvalidRequest("precision_path", f"card {card.model_id!r} does not list precision path {path!r} in "
                             "precision.paths (its contract does not allow serving it in fp8)",
                             allowed=listed or "none: the card allows no fp8 linear path")
    if card.recipe.quantized_from is not None:
        q = card.recipe.quantized_from
        raise InvalidRequest("model", f"card {card.model_id!r} is already quantized (from {q.model_id!r} for {q.path!r})",
                             allowed=f"the original card {q.model_id!r}")
    components = [c for c, globs in card.precision.fp8_targets.items() if globs]
    output = Path(output).expanduser()
    if output.exists():
        raise QuantizeError(f"output: {str(output)!r} exists; give a new folder", param="output")
    new_id = model_id or f"{card.model_id}-{path}"
    if new_id == card.model_id:
        raise InvalidRequest("model_id", f"the quantized card needs its own id, not {card.model_id!r}",
                             allowed=f"e.g. {card.model_id}-{path}")
    instance = build_instance(card, options.model_copy(update={"precision_path": path, "preload_tasks": ()}))
    source = options.source or card.checkpoint.source
    staging = output.with_name(output.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        ckpt_components = dict(card.checkpoint.components)
        from_files = [c for c, spec in card.checkpoint.components.items() if spec.random_init_seed is None]
        if source is not None and from_files:
            # The checkpoint's own files (model_index.json, configs): the output is a checkpoint in the card's layout.
            root = resolve_source(source, local_files_only=options.local_files_only)
            component_folders = {spec.subfolder for spec in card.checkpoint.components.values() if spec.subfolder}
            for item in root.iterdir():
                if item.is_file() and not item.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
                    shutil.copy2(item, staging / item.name)
                elif item.is_dir() and item.name not in component_folders and item.name != staging.name:
                    # Folders that are no component's (a tokenizer, a scheduler config): copied as they are; without
                    # them the written card's text encoder found no tokenizer.
                    shutil.copytree(item, staging / item.name)
            for component_id in from_files:
                spec = card.checkpoint.components[component_id]
                if component_id in components or not spec.subfolder:
                    continue
                src = resolve_source(source, subfolder=spec.subfolder, local_files_only=options.local_files_only)
                shutil.copytree(src, staging / spec.subfolder, dirs_exist_ok=True)
        for component_id in components:
            module = instance.component(component_id)
            if not isinstance(module, nn.Module):
                raise QuantizeError(f"component {component_id!r} is not a torch module; it cannot be quantized",
                                    param="model")
            # The family quantized the targets at load (precision_path); quantize what it left.
            targets = apply_precision_path(card, component_id, module, path)
            left = [t for t in targets if not isinstance(module.get_submodule(t), Fp8Linear)]
            assert not left, left
            spec = card.checkpoint.components[component_id]
            folder = staging / (spec.subfolder or component_id)
            if spec.random_init_seed is None and source is not None:
                src = resolve_source(source, subfolder=spec.subfolder, local_files_only=options.local_files_only)
                shutil.copytree(src, folder, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json", "*.bin"))
            folder.mkdir(parents=True, exist_ok=True)
            if not (folder / "config.json").exists():
                # A seeded component had no files: its config is the card's (the keys its builder takes), written as
                # the folder's config.json so that the folder is a checkpoint in the diffusers convention a family's
                # loader reads (without it fv-wan's loader failed on the missing file).
                (folder / "config.json").write_text(json.dumps(card.components[component_id].config, indent=2) + "\n")
            _save(module, folder / _WEIGHTS_FILE, {"fv_quantized_from": card.model_id, "fv_precision_path": path,
                                                    "fv_weights_version": instance.weights_version})
            ckpt_components[component_id] = spec.model_copy(update={"random_init_seed": None,
                                                                     "subfolder": spec.subfolder or component_id})
        recipe = card.recipe.model_copy(update={
            "assumes_precision": path, "parents": (*card.recipe.parents, card.model_id),
            "quantized_from": QuantizedFrom(model_id=card.model_id, weights_version=instance.weights_version, path=path,  # type: ignore[arg-type]
                                            components=tuple(components), tool=f"fv quantize (fv {__version__})"),
        })
        # Weights that were embedded (seeded) are files now, in the diffusers folder convention.
        layout = "diffusers" if card.checkpoint.layout == "embedded" else card.checkpoint.layout
        checkpoint = card.checkpoint.model_copy(update={"source": str(output.resolve()), "components": ckpt_components,
                                                        "layout": layout})
        summary = f"{card.summary} (fp8 weights for {path}, quantized from {card.model_id})".strip()
        new_card = ModelCard.model_validate({**card.model_dump(), "model_id": new_id, "summary": summary,
                                             "recipe": recipe.model_dump(), "checkpoint": checkpoint.model_dump()})
        (staging / CARD_FILE).write_text(new_card.model_dump_json(indent=2))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rename(output)
    return new_card


def _save(module: nn.Module, file: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    # Tied or shared tensors are written once per key: the loader assigns each key on its own.
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in module.state_dict().items()}
    save_file(state, str(file), metadata={k: json.dumps(v) if not isinstance(v, str) else v for k, v in metadata.items()})
