"""Pre-flight: before a card builds anything, can its weights be found, and do they fit?

Two checks, both from the card alone (nothing is built, nothing is downloaded):

* **Checkpoint source** (:func:`check_checkpoint_source`): a card whose weights are not
  embedded (``checkpoint.layout`` other than ``"embedded"``) needs a source. None at all, a
  local directory without the component's folder, or a hub id that is neither in the local
  Hugging Face cache nor reachable (offline, or the hub does not answer) is one
  :class:`~fv_kernel.errors.CheckpointNotFound` line naming what to download or which flag
  to pass.
* **Memory** (:func:`check_memory`): each component's weight elements
  (``ComponentSpec.parameters``: a count, or a function of the spec the family provides)
  at the component's dtype, summed, against what the target device can still allocate
  (``fv_kernel.runtime.capacity.device_available_bytes``: free GPU memory, or the
  machine's available RAM). Weights that do not fit are one :class:`InsufficientMemory`
  line saying how much is needed and how much is available.

When the source is a local directory (or a cached hub snapshot), each component is charged
the smaller of its declared count and the elements its folder's ``*.safetensors`` headers
store (a loader may keep part of a folder; a checkpoint may hold a smaller model than the
release the card describes), and a component that declares no count is charged what its
folder stores. So the figure is a lower bound of what loading allocates: a refusal is
certain, never a guess. Only weights are counted: activations are admission's business (the
loops' estimates), block pools are allocated on first use. A component counted neither way
is not charged (:attr:`PreflightReport.uncounted` names it).

``build_instance`` (for its preloaded tasks) and ``ModelInstance.load_for_task`` /
``component`` run :func:`preflight` before loading a component, so nothing is allocated
for weights that cannot be found or cannot fit. ``fv generate`` runs it before building the
instance; ``fv serve`` runs :func:`preflight_deployment` over every configured card at
start-up (all of a card's components, summed per device, since any task may arrive).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from fv_kernel.card.spec import ComponentSpec, ModelCard
from fv_kernel.errors import CapacityError, CheckpointNotFound
from fv_kernel.request.types import TaskType
from fv_kernel.compute.device import device_available_bytes, device_key
from fv_kernel.model.component_sources import check_component_sources, component_source

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.model.options import InstanceOptions

__all__ = [
    "ComponentWeights",
    "PreflightReport",
    "InsufficientMemory",
    "component_parameters",
    "components_for_tasks",
    "weights_needed",
    "check_checkpoint_source",
    "check_memory",
    "preflight",
    "preflight_deployment",
    "format_bytes",
    "stored_elements",
]

#: Bytes per weight element of each precision (nvfp4 packs two elements in a byte).
ELEMENT_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3": 1, "nvfp4": 0.5}


def format_bytes(value: int) -> str:
    """``123456789`` -> ``"117.7 MiB"`` (binary units, one decimal)."""
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


class InsufficientMemory(CapacityError):
    """A card's weights need more memory than its target device has available."""

    error_type = "insufficient_memory"

    def __init__(self, report: "PreflightReport", *, reserved: int = 0) -> None:
        assert report.available_bytes is not None
        parts = ", ".join(f"{c.component_id} {format_bytes(c.bytes)} {c.precision}" for c in report.components if c.elements)
        others = f" on top of {format_bytes(reserved)} for the deployment's other cards" if reserved else ""
        smaller = f", or --precision {' / '.join(report.smaller_precisions)}" if report.smaller_precisions else ""
        message = (
            f"card {report.model_id!r} needs {format_bytes(report.weights_bytes)} for its weights ({parts}){others} "
            f"on {report.device}, but only {format_bytes(report.available_bytes)} is available; "
            f"use a device with more memory, a smaller card{smaller}"
        )
        super().__init__(message, param="model")
        self.report = report
        self.reserved = reserved


@dataclass(frozen=True)
class ComponentWeights:
    """One component's weights as the pre-flight counts them."""

    component_id: str
    elements: int
    precision: str

    @property
    def bytes(self) -> int:
        return math.ceil(self.elements * ELEMENT_BYTES[self.precision])


@dataclass(frozen=True)
class PreflightReport:
    """What :func:`preflight` found for one card on one device."""

    model_id: str
    device: str
    components: tuple[ComponentWeights, ...]
    #: Components loaded from files whose weights could not be counted (``parameters`` None).
    uncounted: tuple[str, ...]
    #: Where the weights come from: a directory, a hub id, or None (embedded / seeded).
    source: str | None
    #: What the device could still allocate; None where fv cannot read it (not checked).
    available_bytes: int | None
    #: Precisions the card supports whose elements are smaller than the one asked for (named in the refusal).
    smaller_precisions: tuple[str, ...] = ()

    @property
    def weights_bytes(self) -> int:
        return sum(c.bytes for c in self.components)


def component_parameters(spec: ComponentSpec) -> int | None:
    """The weight elements ``spec`` declares: its count, or what its ``"module:function"`` returns."""
    if spec.parameters is None or isinstance(spec.parameters, int):
        return spec.parameters
    from fv_kernel.model.buildcheck import BuildProblem, InvalidCard
    from fv_kernel.card.refs import import_object

    field = f"components.{spec.component_id}.parameters"
    try:
        counter: Callable[[ComponentSpec], int] = import_object(spec.parameters)
    except (ImportError, AttributeError) as exc:
        raise InvalidCard([BuildProblem(field, f"{spec.parameters!r} does not import: {exc}")]) from None
    count = counter(spec)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise InvalidCard([BuildProblem(field, f"{spec.parameters!r} returned {count!r}, not a count >= 0")])
    return count


def components_for_tasks(card: ModelCard, tasks: Iterable[TaskType] | None) -> list[str]:
    """The components the tasks load (all the card's checkpoint components when ``tasks`` is None), in card order."""
    if tasks is None:
        return list(card.checkpoint.components)
    wanted = set()
    for task in tasks:
        wanted.update(card.checkpoint.components_for(task))
    return [c for c in card.checkpoint.components if c in wanted]


def _precision(card: ModelCard, options: "InstanceOptions") -> str:
    return options.precision or card.precision.default


def weights_needed(card: ModelCard, component_ids: Sequence[str], precision: str) -> tuple[list[ComponentWeights], list[str]]:
    """Each component's weights at its dtype (its precision policy's, else ``precision``), and the uncounted ones."""
    counted: list[ComponentWeights] = []
    uncounted: list[str] = []
    for component_id in component_ids:
        spec = card.components[component_id]
        elements = component_parameters(spec)
        if elements is None:
            uncounted.append(component_id)
            continue
        dtype = spec.precision_policy.dtype
        counted.append(ComponentWeights(component_id, elements, precision if dtype == "card" else dtype))
    return counted, uncounted


def _offline(options: "InstanceOptions") -> bool:
    return options.local_files_only or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")


def _cached_snapshot(source: str) -> Path | None:
    """The local Hugging Face cache's snapshot of ``source``, or None (never touches the network)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub is a plugin dependency
        return None
    try:
        return Path(snapshot_download(source, local_files_only=True))
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError and friends: not cached
        return None


def hub_unreachable(source: str) -> str | None:
    """Why the hub cannot serve ``source`` now (a short reason), or None when it answers."""
    try:
        from huggingface_hub import HfApi
    except ImportError as exc:  # pragma: no cover
        return f"huggingface_hub is not installed ({exc})"
    try:
        HfApi().model_info(source, timeout=10)
    except Exception as exc:  # noqa: BLE001 - connection errors, 404s, gated repos
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    return None


def _missing_folders(root: Path, card: ModelCard, component_ids: Sequence[str]) -> list[str]:
    folders = {card.checkpoint.components[c].subfolder for c in component_ids}
    return sorted(f for f in folders if f and not (root / f).is_dir())


def check_checkpoint_source(card: ModelCard, options: "InstanceOptions", component_ids: Sequence[str]) -> str | None:
    """Where the components' weights load from (None: embedded), or :class:`CheckpointNotFound` in one line.

    Embedded cards and components with seeded random weights need no source. A hub id that
    is not cached is looked up on the hub only when the run is online (not
    ``local_files_only``, no ``HF_HUB_OFFLINE``); loading then downloads it.
    """
    manifest = card.checkpoint
    # A component given a file of its own (component_sources) loads from it, not from the checkpoint.
    from_files = [c for c in component_ids
                  if manifest.components[c].random_init_seed is None and c not in options.component_sources]
    if manifest.layout == "embedded" or not from_files:
        return None
    source = options.source or manifest.source
    folders = sorted({manifest.components[c].subfolder for c in from_files if manifest.components[c].subfolder})
    layout = f"a {manifest.layout}-layout folder" + (f" with {', '.join(f + '/' for f in folders)}" if folders else "")
    if source is None:
        raise CheckpointNotFound(
            f"card {card.model_id!r} has no default checkpoint and its weights are not embedded: download the "
            f"checkpoint and pass its directory as --model PATH ({layout})",
            param="model",
        )
    path = Path(os.path.expanduser(source))
    if path.exists():
        if not path.is_dir():
            raise CheckpointNotFound(f"checkpoint {source!r} of card {card.model_id!r} is a file, not a directory ({layout})", param="model")
        missing = _missing_folders(path, card, from_files)
        if missing:
            raise CheckpointNotFound(
                f"checkpoint {source!r} has no folder {', '.join(repr(m) for m in missing)} that card "
                f"{card.model_id!r} loads ({layout})",
                param="model",
            )
        return str(path)
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise CheckpointNotFound(
            f"checkpoint {source!r} of card {card.model_id!r} is neither an existing directory nor a Hugging Face "
            "repo id ('org/name')",
            param="model",
        )
    download = f"download it first (hf download {source} --local-dir DIR) and pass --model DIR"
    snapshot = _cached_snapshot(source)
    if snapshot is not None:
        missing = _missing_folders(snapshot, card, from_files)
        if missing and _offline(options):
            raise CheckpointNotFound(
                f"the cached {source!r} lacks {', '.join(repr(m) for m in missing)} and this run is offline: {download}",
                param="model",
            )
        return source
    if _offline(options):
        raise CheckpointNotFound(
            f"card {card.model_id!r} needs checkpoint {source!r}, which is not in the local Hugging Face cache, and this "
            f"run is offline (HF_HUB_OFFLINE / local_files_only): {download}",
            param="model",
        )
    reason = hub_unreachable(source)
    if reason is not None:
        raise CheckpointNotFound(
            f"card {card.model_id!r} needs checkpoint {source!r}, which is not in the local Hugging Face cache, and the "
            f"hub did not answer ({reason}): {download}",
            param="model",
        )
    return source


def check_memory(report: PreflightReport, *, reserved: int = 0) -> None:
    """Refuse (:class:`InsufficientMemory`) when the report's weights, plus ``reserved`` bytes promised
    to other cards on the device, exceed what it has available."""
    if report.available_bytes is not None and report.weights_bytes + reserved > report.available_bytes:
        raise InsufficientMemory(report, reserved=reserved)


def stored_elements(folder: Path, *, fp8_only: bool = False) -> int | None:
    """Weight elements stored in a folder's ``*.safetensors`` files (or in one such file), from their
    headers alone (no tensor is read); None when there are none. ``fp8_only``: only the fp8 tensors'
    (an fp8 card's e4m3 weights, or a ComfyUI fp8 file's, which load as stored)."""
    files = [folder] if folder.is_file() else sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        try:
            with open(file, "rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(length))
        except (OSError, ValueError):
            return None  # unreadable: loading will name the problem
        total += sum(math.prod(entry["shape"]) for key, entry in header.items()
                     if key != "__metadata__" and (not fp8_only or str(entry.get("dtype", "")).startswith("F8")))
    return total


def _split_stored_fp8(card: ModelCard, weights: ComponentWeights, folder: Path | None) -> list[ComponentWeights]:
    """A component whose checkpoint stores fp8 targets (``fv quantize``), or whose own file stores fp8
    tensors (a ComfyUI fp8 file): its e4m3 elements charged at one byte (the least they take: the
    fp8-linear paths keep them as stored), the rest at its precision."""
    quantized = card.recipe.quantized_from
    own_file = folder is not None and folder.is_file()  # a component source: its fp8 tensors load as stored
    if folder is None or (not own_file and (quantized is None or weights.component_id not in quantized.components)):
        return [weights]
    fp8 = min(stored_elements(folder, fp8_only=True) or 0, weights.elements)
    if not fp8:
        return [weights]
    return [ComponentWeights(weights.component_id, fp8, "fp8_e4m3"),
            ComponentWeights(weights.component_id, weights.elements - fp8, weights.precision)]


def _local_root(source: str | None) -> Path | None:
    if source is None:
        return None
    path = Path(os.path.expanduser(source))
    return path if path.is_dir() else _cached_snapshot(source)


def _stored_at(card: ModelCard, options: "InstanceOptions", component_id: str, root: Path | None) -> Path | None:
    """Where a component's weights are stored: its own file (``component_sources``), else its checkpoint folder."""
    own = component_source(options, component_id)
    if own is not None:
        return own
    subfolder = card.checkpoint.components[component_id].subfolder
    return root / subfolder if root is not None and subfolder else None


def _with_stored_counts(card: ModelCard, options: "InstanceOptions", counted: list[ComponentWeights],
                        root: Path | None) -> list[ComponentWeights]:
    """Each component charged the smaller of the card's count and the elements its checkpoint folder
    (or its own file) stores: a loader may keep part of a folder (one half of a VAE), and a checkpoint
    given by path may hold a smaller model than the release the card describes (a derived card's encoders)."""
    charged = []
    for weights in counted:
        folder = _stored_at(card, options, weights.component_id, root)
        stored = stored_elements(folder) if folder is not None else None
        elements = weights.elements if stored is None else min(weights.elements, stored)
        charged.extend(_split_stored_fp8(card, ComponentWeights(weights.component_id, elements, weights.precision), folder))
    return charged


def _report(card: ModelCard, options: "InstanceOptions", component_ids: Sequence[str], source: str | None) -> PreflightReport:
    precision = _precision(card, options)
    counted, uncounted = weights_needed(card, component_ids, precision)
    root = _local_root(source)
    counted = _with_stored_counts(card, options, counted, root)
    for component_id in list(uncounted):
        folder = _stored_at(card, options, component_id, root)
        stored = stored_elements(folder) if folder is not None else None
        if stored is not None:
            assert folder is not None
            spec_dtype = card.components[component_id].precision_policy.dtype
            counted.extend(_split_stored_fp8(
                card, ComponentWeights(component_id, stored, precision if spec_dtype == "card" else spec_dtype), folder))
            uncounted.remove(component_id)
    try:
        available: int | None = device_available_bytes(options.device)
    except (CapacityError, RuntimeError, ValueError):  # a device fv cannot size: not checked
        available = None
    manifest = card.checkpoint
    from_files = {c for c in component_ids if manifest.components[c].random_init_seed is None}
    return PreflightReport(
        model_id=card.model_id, device=_device_name(options.device), components=tuple(counted),
        uncounted=tuple(c for c in uncounted if c in from_files and manifest.layout != "embedded"),
        source=source, available_bytes=available,
        # (none when the recipe fixes the precision: another one would be a recipe mismatch)
        smaller_precisions=() if card.recipe.assumed_dtype is not None else tuple(
            p for p in card.precisions if ELEMENT_BYTES[p] < ELEMENT_BYTES[precision]
        ),
    )


def _device_name(device: str) -> str:
    try:
        return device_key(device)
    except (RuntimeError, ValueError):
        return device


def preflight(
    card: ModelCard,
    options: "InstanceOptions",
    tasks: Iterable[TaskType] | None = None,
    *,
    component_ids: Sequence[str] | None = None,
    reserved: int = 0,
) -> PreflightReport:
    """Check ``card``'s checkpoint source and memory for the components ``tasks`` load (all when None),
    or exactly ``component_ids``; nothing is built. Raises :class:`CheckpointNotFound` or
    :class:`InsufficientMemory` (one line each)."""
    ids = list(component_ids) if component_ids is not None else components_for_tasks(card, tasks)
    check_component_sources(card, options)
    source = check_checkpoint_source(card, options, ids)
    report = _report(card, options, ids, source)
    check_memory(report, reserved=reserved)
    return report


def preflight_deployment(plans: Sequence[tuple[ModelCard, "InstanceOptions"]]) -> list[PreflightReport]:
    """:func:`preflight` for every card a deployment makes resident, all its components each, the
    weights of the cards on one device summed (the second card is refused if both do not fit)."""
    reports: list[PreflightReport] = []
    promised: dict[str, int] = {}
    for card, options in plans:
        device = _device_name(options.device)
        report = preflight(card, options, None, reserved=promised.get(device, 0))
        promised[device] = promised.get(device, 0) + report.weights_bytes
        reports.append(report)
    return reports
