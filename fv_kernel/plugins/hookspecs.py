"""Hook specifications of fv: the pluggy contract between the kernel and plugins.

Project name ``"fv"``. A plugin module implements any subset of these hooks with
:data:`hookimpl`::

    from fv_kernel.api import hookimpl

    @hookimpl
    def fv_register_samplers(register):
        register("my-sampler", MySampler)

The kernel never calls ``pm.hook.*`` directly outside :mod:`fv_kernel.plugins.hooks`;
it goes through the typed façade :class:`~fv_kernel.plugins.hooks.PluginHooks`.

Registration hooks receive ``register(name: str, obj: object)``. ``name`` is the
short contribution name; the kernel namespaces it as ``"<plugin>/<name>"``.
Registration must be cheap: build specs and classes, never load weights or touch
CUDA. The host runs each plugin's registration hooks once, when it registers the
plugin (at start), and checks what they register; a hook that raises, or registers
something invalid, disables that plugin alone. Named drivers (attention backends,
transports, and any ``fv.<kind>`` entry-point group) are not registered through
hooks; they are declared as entry points and imported only when selected.
"""

from __future__ import annotations

from typing import Any, Callable, Generator

import pluggy

PROJECT_NAME = "fv"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marker for plugin hook implementations: ``@hookimpl`` or ``@hookimpl(wrapper=True)``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: The callback handed to registration hooks.
Register = Callable[[str, object], None]


# --------------------------------------------------------------------------- registration
# Called once per plugin, when the host registers it (at start); results are checked and kept.


@hookspec
def fv_register_model_cards(register: Register) -> None:
    """Register model cards: ``register("wan-tiny", card)``.

    ``card`` is a :class:`fv_kernel.card.ModelCard` instance. Building it must not
    read weights; weights load when an engine starts the card.
    """


@hookspec
def fv_register_loops(register: Register) -> None:
    """Register loop classes (subclasses of :class:`fv_kernel.loop.Loop`)."""


@hookspec
def fv_register_samplers(register: Register) -> None:
    """Register sampler classes (subclasses of :class:`fv_kernel.loop.samplers.Sampler`)."""


@hookspec
def fv_register_interceptors(register: Register) -> None:
    """Register interceptor classes (subclasses of :class:`fv_kernel.extend.Interceptor`).

    Interceptors alter compute; their per-request state lives in ``LoopState.plugin_state``.
    """


@hookspec
def fv_register_observers(register: Register) -> None:
    """Register observer classes (subclasses of :class:`fv_kernel.extend.Observer`). Observers are read-only."""


@hookspec
def fv_register_rl_methods(register: Register) -> None:
    """Register RL method classes (subclasses of :class:`fv_kernel.training.RLMethod`)."""


@hookspec
def fv_register_rewards(register: Register) -> None:
    """Register reward classes (subclasses of :class:`fv_kernel.training.Reward`) for RL methods."""


@hookspec
def fv_register_program_compilers(register: Register) -> None:
    """Register program compiler classes (subclasses of :class:`fv_kernel.program.ProgramCompiler`)."""


# --------------------------------------------------------------------------- lifecycle (broadcast)


@hookspec(historic=True)
def fv_host_started(host: Any) -> None:
    """The plugin host (a :class:`~fv_kernel.plugins.host.PluginHost`) finished loading the enabled plugins.

    The host is the caller of this module, so the spec names it in words, not by import.

    Historic: a plugin registered later is called with the same host on registration.
    """


@hookspec
def fv_engine_started(engine: Any) -> None:
    """An engine finished loading its card and is ready to accept requests."""


@hookspec
def fv_engine_stopping(engine: Any) -> None:
    """An engine is about to stop; release what was acquired in :func:`fv_engine_started`."""


@hookspec
def fv_request_finished(request_id: str, status: str) -> None:
    """A request reached a terminal status (e.g. ``"succeeded"``, ``"failed"``, ``"cancelled"``)."""


@hookspec
def fv_step_finished(event: Any) -> None:
    """A loop step finished. Observer-style: ``event`` is read-only; do not mutate it or the state it references."""


@hookspec
def fv_serving_routes(app: Any, engine: Any, config: Any) -> None:
    """Mount a plugin's HTTP routes on ``fv serve``'s FastAPI ``app`` (called once, when the app is built).

    ``engine`` is the running :class:`fv_kernel.runtime.Engine`, ``config`` the
    :class:`fv_kernel.config.DeployConfig`. Add routes with ``app.add_api_route``,
    ``app.include_router`` or ``app.add_api_websocket_route``; the kernel's auth, body-size
    limit and metrics middleware wrap them as they wrap the kernel's own. Each plugin's
    implementation is called on its own: if it raises, or adds a route whose path and method
    a kernel route (or an earlier plugin) already serves, every route it added is removed, the
    server starts without them and says so in one warning line (``app.state.plugin_routes``
    records each plugin's outcome).
    """


# --------------------------------------------------------------------------- single answer (firstresult)


@hookspec(firstresult=True)
def fv_resolve_model_source(source: str) -> Any:
    """Map a model source (local directory, hub id, alias) to a model card.

    Return an installed card's id (``"<plugin>/<name>"`` or a unique short name), a
    :class:`fv_kernel.card.ModelCard` derived from the source (a checkpoint no installed
    card describes; its id must not be an installed card's, and it is build-checked
    before use), or ``None`` to let the next plugin try. The first non-``None`` answer
    wins. A source the plugin recognises but cannot serve (a missing file, an unsupported
    config field) raises a typed ``fv_kernel.api.FvError`` saying so.
    """


@hookspec(firstresult=True)
def fv_default_model() -> str | None:
    """The card id used when a request names no model, or ``None``. The first non-``None`` answer wins."""


@hookspec(firstresult=True)
def fv_export_checkpoint(card: Any, modules: Any, directory: Any) -> Any:
    """Write ``card``'s weights as a checkpoint directory its family's reference loads.

    ``modules`` maps component ids to modules that replace what the card would load (a
    trainer's trained components); components not in it load as the card loads them.
    Return the :class:`fv_kernel.card.ModelCard` that serves ``directory`` (its checkpoint
    source set to it), or ``None`` when the card is not this plugin's family. Used by
    ``fv cards export`` and ``fv train``, which check parity before keeping the directory.
    """


@hookspec(firstresult=True)
def fv_check_parity(card: Any, directory: Any) -> Any:
    """Run ``card``'s parity check (its ``ParitySpec``) on the checkpoint at ``directory``.

    Return a :class:`fv_kernel.training.ParityResult` (the reference's output compared with
    fv's within the card's tolerance), or ``None`` when the card is not this plugin's family.
    """


# --------------------------------------------------------------------------- wrapping


@hookspec(firstresult=True)
def fv_wrap_generate(request: Any) -> Generator[None, Any, Any]:
    """Wrap the blocking generate path of one request (implement with ``@hookimpl(wrapper=True)``).

    Contract: the wrapper yields exactly once; ``result = yield`` receives the
    generate result (or re-raises its exception at the ``yield``), and the wrapper
    must return the result — the same object or a replacement. Wrappers must not
    change which plugins run or the request's model; they may time, trace, retry
    or post-process. The innermost call is the kernel's own generate; a plain
    (non-wrapper) implementation of this hook is refused at registration.
    """
