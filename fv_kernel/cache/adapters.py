"""The adapter registry and the adapter cache: disk → (pinned) CPU → device (docs/adapters.md).

Adapters are registered by name (a file of a scanned directory, a file given at the command
line, an upload) and versioned by a sha256 over their bytes and what those convert to, so a name
re-registered with other weights is another version and never shares a cache entry with the old one.

Weights move through three tiers. Disk holds every registered file. The CPU tier holds
converted weights (page-locked when CUDA is available, so a copy to the GPU can overlap with
compute), least recently used first out, within ``cpu_budget_bytes``. The device tier holds the
copies the forward reads, per device, within ``device_budget_bytes``. An admitted request pins
its adapters on its device (:meth:`AdapterRegistry.acquire`) until it ends
(:meth:`AdapterRegistry.release`): a pinned adapter is never evicted, and an adapter that cannot
fit beside the pinned ones is refused with :class:`~fv_kernel.errors.CapacityError`.

This module knows nothing of what the tensors mean: a converter (the card's
``adapter_format``, ``fv_kernel.model.adapters.converter_for``) turns a file into per-component
weights, which need only ``nbytes``, ``max_rank`` and ``to(device)``.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Callable, Literal, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fv_kernel.card.adapters import (
    ADAPTER_SUFFIX, ASSUMES_LOOP_KEY, ASSUMES_STEPS_KEY, AdapterFile, read_adapter_bytes, read_adapter_file,
)
from fv_kernel.errors import AdapterFileError, CapacityError, UnknownAdapter

__all__ = ["AdapterInfo", "AdapterSettings", "AdapterRegistry", "TierStats"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: ``convert(state_dict, *, name, metadata) -> {component_id: weights}``.
Converter = Callable[..., Mapping[str, Any]]


class AdapterSettings(BaseModel):
    """The deploy config's ``adapters:`` section: where adapters come from and what they may cost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Adapters are on (requests and cards may name them). Off: ``adapters`` in a request is refused.
    enabled: bool = True
    #: A directory whose ``*.safetensors`` files are registered at start (name: the file's stem).
    directory: Path | None = None
    #: Where uploaded adapters are written (content-addressed: ``<first 16 hex digits of the sha256 of the bytes>.safetensors``); None: a
    #: temporary directory of the process, removed when the registry goes (uploads never sit in memory).
    upload_directory: Path | None = None
    #: The largest adapter file (or upload) accepted, in bytes.
    max_file_bytes: int = Field(default=2 * 2**30, gt=0)
    #: Converted adapters kept in CPU memory (pinned when CUDA is available), least recently used out.
    cpu_budget_bytes: int = Field(default=8 * 2**30, ge=0)
    #: Adapter weights kept on each device for the forward; admission reserves within it.
    device_budget_bytes: int = Field(default=2 * 2**30, ge=0)
    #: The most adapters one request's stack may hold (card defaults included); every request's
    #: step inputs carry this many slots, so requests with different stacks still batch.
    max_stack: int = Field(default=4, ge=1, le=64)
    #: ``auto``: a run of steps that all use one stack merges it into the weights (no per-row cost)
    #: when the cost model says that pays; ``never``: always per row. Exact requests never merge.
    merge: Literal["never", "auto"] = "auto"

    @field_validator("directory")
    @classmethod
    def _directory_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_dir():
            raise ValueError(f"{str(value)!r} is not a directory (the adapters to register at start)")
        return value

    @model_validator(mode="after")
    def _distinct_directories(self) -> "AdapterSettings":
        if self.upload_directory is not None and self.directory is not None and \
                self.upload_directory.resolve() == self.directory.resolve():
            raise ValueError("upload_directory must differ from directory: uploads are named by version, not by name")
        return self


class AdapterInfo(BaseModel):
    """What the registry knows of one adapter version (``fv adapters list``, ``GET /v1/adapters``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    #: The content version: 16 hex digits of a sha256 over the file's bytes and the weights they
    #: convert to (one file read for two components, e.g. each Wan 2.2 expert, is two versions).
    version: str
    #: The file it is read from.
    path: str
    size_bytes: int
    #: The card components it changes (``transformer``, ``text_encoder``...).
    components: tuple[str, ...]
    #: Its largest LoRA rank (0: full deltas only).
    rank: int
    #: Bytes of its converted weights: what it costs in the CPU and device tiers.
    weight_bytes: int
    #: A distilled adapter's loop (a card loop id) and step count; a request with another is a
    #: ``RecipeMismatch`` unless the deployment overrides the recipe.
    assumes_loop: str | None = None
    assumes_steps: int | None = None
    source: Literal["file", "directory", "upload"] = "file"


@dataclass
class TierStats:
    """Bytes and entries of one tier."""

    bytes: int = 0
    entries: int = 0
    evictions: int = 0
    #: Entries brought in (a file read and converted, or a copy to the device).
    loads: int = 0


@dataclass
class _Version:
    info: AdapterInfo
    id: int = 0
    #: The sha256 of the file's bytes, to tell a file changed on disk since it was registered.
    file_sha256: str = ""


@dataclass
class _Tier:
    budget: int
    entries: "OrderedDict[Any, tuple[dict[str, Any], int]]" = field(default_factory=OrderedDict)
    used: int = 0
    evictions: int = 0
    loads: int = 0


def _weights_bytes(weights: Mapping[str, Any]) -> int:
    return sum(int(w.nbytes) for w in weights.values())


def _pin(weights: Any) -> Any:
    """The weights on the CPU; page-locked on CUDA hosts, so a copy to the GPU can run asynchronously."""
    cpu = weights.to("cpu")
    if not torch.cuda.is_available():
        return cpu
    return type(cpu)(
        cpu.name, cpu.component,
        {p: type(u)(u.down.pin_memory(), u.up.pin_memory(), u.alpha, None if u.bias is None else u.bias.pin_memory())
         for p, u in cpu.low_rank.items()},
        {p: t.pin_memory() for p, t in cpu.deltas.items()},
        version=cpu.version,
    )


class AdapterRegistry:
    """Named, versioned adapters and their CPU and device tiers. Thread-safe."""

    def __init__(self, converter: Converter, settings: AdapterSettings | None = None) -> None:
        self.settings = settings or AdapterSettings()
        self._convert = converter
        self._lock = threading.RLock()
        self._names: dict[str, str] = {}  # name -> current version
        #: One entry per content version (two names with the same bytes share its tiers and id).
        self._versions: dict[str, _Version] = {}
        self._infos: dict[tuple[str, str], AdapterInfo] = {}
        self._ids: dict[int, str] = {}
        self._cpu = _Tier(self.settings.cpu_budget_bytes)
        self._device: dict[str, _Tier] = {}
        self._pins: dict[tuple[str, str], int] = {}
        self._scratch: tempfile.TemporaryDirectory[str] | None = None

    # ------------------------------------------------------------------ names and versions

    def list(self) -> list[AdapterInfo]:
        """Every registered adapter's current version, by name."""
        with self._lock:
            return [self._infos[(n, self._names[n])] for n in sorted(self._names)]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._names)

    def get(self, name: str, version: str | None = None, *, param: str = "adapters") -> AdapterInfo:
        """The adapter registered as ``name`` (its current version, or ``version``), else
        :class:`UnknownAdapter` naming ``param`` with the registered names."""
        with self._lock:
            current = self._names.get(name)
            if current is None:
                raise UnknownAdapter(name, self._names, param=param)
            wanted = version or current
            info = self._infos.get((name, wanted))
            if info is None:
                raise UnknownAdapter(f"{name}@{wanted}", [f"{name}@{current}"], param=param)
            return info

    def info_of(self, version: str) -> AdapterInfo:
        """What the registry knows of ``version`` (KeyError for a version never registered)."""
        with self._lock:
            return self._versions[version].info

    def id_of(self, version: str) -> int:
        """The small integer that stands for ``version`` in step inputs (``adapter_ids``)."""
        with self._lock:
            return self._versions[version].id

    def version_of(self, adapter_id: int) -> str:
        with self._lock:
            try:
                return self._ids[adapter_id]
            except KeyError:
                raise KeyError(f"no adapter has id {adapter_id}") from None

    # ------------------------------------------------------------------ registering

    def add_file(
        self, path: str | Path, *, name: str | None = None, source: Literal["file", "directory", "upload"] = "file",
        assumes_loop: str | None = None, assumes_steps: int | None = None,
    ) -> AdapterInfo:
        """Register ``path`` as ``name`` (default: the file's stem). The file is read, converted and
        checked now, so a bad file is refused here and not mid-request."""
        path = Path(path)
        name = name or path.stem
        self._check_name(name)
        file = read_adapter_file(path, max_bytes=self.settings.max_file_bytes)
        return self._register(name, file, str(path.resolve()), source, assumes_loop, assumes_steps)

    def add_bytes(
        self, filename: str, data: bytes, *, name: str | None = None,
        assumes_loop: str | None = None, assumes_steps: int | None = None,
    ) -> AdapterInfo:
        """Register an upload. ``filename`` must be a bare ``.safetensors`` name (no directory
        part, no ``..``); the adapter's name defaults to its stem. Written to
        ``upload_directory`` as ``<sha256 of the bytes, 16 hex digits>.safetensors`` when one is set."""
        if not filename or any(sep in filename for sep in ("/", "\\", "\0")) or filename in (".", "..") or \
                PurePosixPath(filename).name != filename or PureWindowsPath(filename).name != filename:
            raise AdapterFileError(f"upload file name {filename!r} must be a bare file name, without a directory part",
                                   param="file")
        if not filename.endswith(ADAPTER_SUFFIX):
            raise AdapterFileError(f"upload file name {filename!r} must end in {ADAPTER_SUFFIX}", param="file")
        name = name or filename[: -len(ADAPTER_SUFFIX)]
        self._check_name(name)
        file = read_adapter_bytes(data, where=f"upload {filename!r}", max_bytes=self.settings.max_file_bytes)
        weights = self._converted(name, file)  # a file that does not convert is never written
        directory = self._upload_directory()
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"{file.sha256[:16]}{ADAPTER_SUFFIX}"
        if not target.exists():
            partial = target.with_suffix(".partial")
            partial.write_bytes(data)
            partial.replace(target)
        return self._register(name, file, str(target.resolve()), "upload", assumes_loop, assumes_steps, weights)

    def _upload_directory(self) -> Path:
        if self.settings.upload_directory is not None:
            return self.settings.upload_directory
        with self._lock:
            if self._scratch is None:
                self._scratch = tempfile.TemporaryDirectory(prefix="fv-adapter-uploads-")
            return Path(self._scratch.name)

    def scan(self, directory: str | Path) -> list[AdapterInfo]:
        """Register every ``*.safetensors`` file directly in ``directory`` under its stem."""
        directory = Path(directory)
        if not directory.is_dir():
            raise AdapterFileError(f"adapters.directory {directory} is not a directory", param="adapters.directory")
        return [self.add_file(p, source="directory") for p in sorted(directory.glob(f"*{ADAPTER_SUFFIX}")) if p.is_file()]

    def _check_name(self, name: str) -> None:
        if not _NAME_RE.match(name):
            raise AdapterFileError(
                f"adapter name {name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
                param="name",
            )

    def _converted(self, name: str, file: AdapterFile) -> Mapping[str, Any]:
        weights = self._convert(dict(file.tensors), name=name, metadata=dict(file.metadata))
        if not weights:
            raise AdapterFileError(f"adapter {name!r}: the converter found no component to change")
        return weights

    def _register(
        self, name: str, file: AdapterFile, path: str, source: Any,
        assumes_loop: str | None, assumes_steps: int | None, weights: Mapping[str, Any] | None = None,
    ) -> AdapterInfo:
        if weights is None:
            weights = self._converted(name, file)
        loop = assumes_loop if assumes_loop is not None else file.metadata.get(ASSUMES_LOOP_KEY)
        steps_raw: Any = assumes_steps if assumes_steps is not None else file.metadata.get(ASSUMES_STEPS_KEY)
        try:
            steps = None if steps_raw is None else int(steps_raw)
        except ValueError:
            steps = -1
        if steps is not None and steps < 1:
            raise AdapterFileError(f"adapter {name!r}: {ASSUMES_STEPS_KEY} must be a positive step count, got {steps_raw!r}")
        # The file and what it converts to: one file read for two components (a Wan 2.2 LoRA named for
        # each expert) is two versions, never one entry overwritten by the other.
        converted = "|".join(f"{c}={weights[c].version}" for c in sorted(weights))
        version = hashlib.sha256(f"{file.sha256}|{converted}".encode()).hexdigest()[:16]
        info = AdapterInfo(
            name=name, version=version, path=path, size_bytes=file.size_bytes, components=tuple(sorted(weights)),
            rank=max((int(w.max_rank) for w in weights.values()), default=0), weight_bytes=_weights_bytes(weights),
            assumes_loop=loop, assumes_steps=steps, source=source,
        )
        with self._lock:
            entry = self._versions.get(version)
            if entry is None:
                entry = _Version(info, id=len(self._ids), file_sha256=file.sha256)
                self._ids[entry.id] = version
                self._versions[version] = entry
            self._infos[(name, version)] = info
            self._names[name] = version
            self._put(self._cpu, version, {c: _pin(w) for c, w in weights.items()}, pinned=set())
        return info

    # ------------------------------------------------------------------ tiers

    def _put(self, tier: _Tier, key: Any, weights: dict[str, Any], pinned: set[Any], device: str = "cpu") -> None:
        size = _weights_bytes(weights)
        if key in tier.entries:
            tier.entries.move_to_end(key)
            return
        while tier.used + size > tier.budget and tier.entries:
            victim = next((k for k in tier.entries if k not in pinned), None)
            if victim is None:
                break
            _, freed = tier.entries.pop(victim)
            tier.used -= freed
            tier.evictions += 1
        if tier.used + size > tier.budget:
            if tier is self._cpu:
                return  # the CPU tier is a cache: a miss re-reads the file
            raise CapacityError(
                f"adapter weights of {size} bytes do not fit the {tier.budget}-byte adapter budget of device {device} "
                f"beside {tier.used} bytes of adapters in use (adapters.device_budget_bytes)",
                param="adapters",
            )
        tier.entries[key] = (weights, size)
        tier.used += size
        tier.loads += 1

    def stage(self, version: str) -> None:
        """Bring ``version`` into the CPU tier (read and converted from disk if it is not there):
        the slow half of a load, run off the device thread."""
        self._cpu_weights(version)

    def _cpu_weights(self, version: str) -> dict[str, Any]:
        with self._lock:
            hit = self._cpu.entries.get(version)
            if hit is not None:
                self._cpu.entries.move_to_end(version)
                return hit[0]
            entry = self._versions[version]
        where = entry.info.path
        file = read_adapter_file(where)
        if file.sha256 != entry.file_sha256:
            raise AdapterFileError(
                f"adapter {entry.info.name!r} version {version}: its file {where} changed since it was registered; "
                "register it again"
            )
        weights = {c: _pin(w) for c, w in self._convert(dict(file.tensors), name=entry.info.name,
                                                         metadata=dict(file.metadata)).items()}
        with self._lock:
            self._put(self._cpu, version, weights, pinned=set())
        return weights

    def resident(self, version: str, device: str | torch.device) -> bool:
        """Whether ``version`` is in ``device``'s tier (a step can use it without a load)."""
        with self._lock:
            return version in self._tier(str(device)).entries

    def _tier(self, device: str) -> _Tier:
        return self._device.setdefault(device, _Tier(self.settings.device_budget_bytes))

    def load(self, version: str, device: str | torch.device) -> dict[str, Any]:
        """``version``'s weights on ``device``, by component: read and converted from disk if they
        are in no tier, copied from the CPU tier if not on the device. Evicts the least recently
        used unpinned adapters of the device tier to fit; :class:`CapacityError` when the pinned
        ones leave no room."""
        device = str(device)
        with self._lock:
            tier = self._tier(device)
            hit = tier.entries.get(version)
            if hit is not None:
                tier.entries.move_to_end(version)
                return hit[0]
        cpu = self._cpu_weights(version)
        on_device = {c: w.to(device) for c, w in cpu.items()}
        with self._lock:
            tier = self._tier(device)
            if version not in tier.entries:
                pinned = {v for (v, d), n in self._pins.items() if d == device and n > 0}
                self._put(tier, version, on_device, pinned, device)
            return tier.entries[version][0]

    def weights(self, version: str, component: str, device: str | torch.device) -> Any:
        """One component's weights of ``version`` on ``device`` (loaded if needed)."""
        loaded = self.load(version, device)
        if component not in loaded:
            raise KeyError(f"adapter version {version} changes no {component!r}")
        return loaded[component]

    def acquire(self, versions: "list[str] | tuple[str, ...]", device: str | torch.device) -> None:
        """Pin ``versions`` on ``device`` for an admitted request: never evicted until released."""
        with self._lock:
            for version in versions:
                key = (version, str(device))
                self._pins[key] = self._pins.get(key, 0) + 1

    def release(self, versions: "list[str] | tuple[str, ...]", device: str | torch.device) -> None:
        with self._lock:
            for version in versions:
                key = (version, str(device))
                left = self._pins.get(key, 0) - 1
                if left > 0:
                    self._pins[key] = left
                else:
                    self._pins.pop(key, None)

    def pinned(self, version: str, device: str | torch.device) -> int:
        with self._lock:
            return self._pins.get((version, str(device)), 0)

    def weight_bytes(self, version: str) -> int:
        with self._lock:
            return self._versions[version].info.weight_bytes

    def stats(self) -> dict[str, TierStats]:
        """Bytes, entries and evictions per tier: ``host`` (the CPU tier), then each device by name."""
        with self._lock:
            out = {"host": TierStats(self._cpu.used, len(self._cpu.entries), self._cpu.evictions, self._cpu.loads)}
            for device, tier in self._device.items():
                out[device] = TierStats(tier.used, len(tier.entries), tier.evictions, tier.loads)
            return out
