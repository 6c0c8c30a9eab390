"""``jupyter gpu-hotplug agent``: the node agent's configuration and process life.

Why traitlets: the agent is configured like every Jupyter program — a config file
(``--config=/etc/gpu-hotplug/agent_config.py``, ``c.AgentApp.max_gpus_per_target = 2``) and
command-line flags (``--listen``, ``--simulate 4``...). Precedence: command line, then config
file, then defaults. The settings' traits and flags are generated from their one declaration,
the fields of ``AgentSettings`` and ``KubernetesSettings`` (``settings.py``); the traits are
resolved once into the typed ``AgentSettings`` that the rest of the agent uses, and the
resolved configuration is logged at start. The traits written here are the process's own
(logging, the config file), which the agent's components never see.

Two settings are read from the environment: ``$NODE_NAME`` is the default of ``--node-name``
(Kubernetes mode; the DaemonSet sets it from the downward API), and a test hook,
``GPU_HOTPLUG_TEST_PAUSE_AT``, names a step at which attach or detach stops for good (see
``checkpoints``), so crash tests can kill the agent exactly there. It is logged loudly when set.

Process life: ``start`` runs the agent on a fresh event loop until SIGTERM or SIGINT (graceful
stop: running operations finish); SIGHUP runs a reconciliation pass at once (for example after
``systemctl daemon-reload`` re-applied a unit's device list).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from traitlets import Bool, Enum, Float, Int, List, TraitType, Unicode, default, observe
from traitlets.config import Application

from .._version import __version__
from .core.checkpoints import STEPS
from .logs import logging_config
from .settings import (
    AgentSettings,
    KubernetesSettings,
    LogStyle,
    Option,
    SettingsError,
    TestHooks,
    options,
)

__all__ = ["PAUSE_ENV", "AgentApp", "main"]

PAUSE_ENV: Final = "GPU_HOTPLUG_TEST_PAUSE_AT"

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1


def _declared() -> Iterator[tuple[str, Option, object]]:
    """The agent's settings, as ``AgentSettings`` and ``KubernetesSettings`` declare them."""
    for settings in (AgentSettings, KubernetesSettings):
        yield from options(settings)


def _trait(option: Option, text: object) -> TraitType[Any, Any]:
    """The trait a setting is given through, with ``text`` (its default's text form) as its
    default: an ``Enum`` of its choices, else one of the text form's type."""
    trait: TraitType[Any, Any]
    if option.choices:
        trait = Enum(list(option.choices), default_value=text, help=option.help)
    elif isinstance(text, list):
        trait = List(Unicode(), default_value=text, help=option.help)
    elif isinstance(text, int):
        trait = Int(text, help=option.help)
    elif isinstance(text, float):
        trait = Float(text, help=option.help)
    elif isinstance(text, str):
        trait = Unicode(text, help=option.help)
    else:
        raise TypeError(f"no trait for a setting whose text form is {text!r}")
    return trait.tag(config=True)


def _from_environment(variable: str, text: object) -> Callable[[Any], object]:
    def read(app: Any) -> object:
        return os.environ.get(variable, text)

    return read


def _setting_traits() -> dict[str, Any]:
    """``AgentApp``'s class attributes for the declared settings: a trait each, named as its
    field, and the default generator of one whose default is read from the environment."""
    attributes: dict[str, Any] = {}
    for name, option, value in _declared():
        if name in attributes:
            raise TypeError(f"the setting {name!r} is declared twice")
        text = option.text(value)
        attributes[name] = _trait(option, text)
        if option.env is not None:
            attributes[f"_default_{name}"] = default(name)(_from_environment(option.env, text))
    return attributes


class AgentApp(Application):
    """The node agent (see the module docstring)."""

    name = "jupyter-gpu-hotplug-agent"
    version = __version__
    description = (
        "The jupyter-gpu-hotplug node agent: attaches GPUs to running containers and processes "
        "on this node. Runs as root."
    )
    examples = """
jupyter gpu-hotplug agent --simulate=4 --state-dir=/var/lib/gpu-hotplug-sim --listen=127.0.0.1:8477
jupyter gpu-hotplug agent --listen=unix:/run/gpu-hotplug/agent.sock --listen=:8477
"""

    # The settings' traits, generated from their declarations: the class body's namespace is
    # what traitlets' metaclass reads, so they are traits like the ones written below.
    vars().update(_setting_traits())

    # traitlets reads these class attributes; they are never mutated.
    aliases: dict[str, Any] = {  # noqa: RUF012
        **{
            option.flag: f"AgentApp.{name}"
            for name, option, _ in _declared()
            if option.flag is not None
        },
        "log-level": "AgentApp.log_level",
        "log-format": "AgentApp.log_style",
        "config": "AgentApp.config_file",
    }
    flags: dict[str, Any] = {  # noqa: RUF012
        "show-config-json": (
            {"AgentApp": {"show_resolved_config": True}},
            "Print the resolved settings as JSON and exit.",
        ),
    }

    log_style = Enum(
        [style.value for style in LogStyle],
        default_value=LogStyle.TEXT.value,
        help="Log output: 'text' for people, 'json' (one object per line) for log shippers.",
    ).tag(config=True)
    config_file = Unicode(
        "", help="A Python config file (c.AgentApp.<setting> = ...); the command line wins."
    ).tag(config=True)
    show_resolved_config = Bool(False, help="Print the resolved settings as JSON and exit.").tag(
        config=True
    )

    @default("log_level")
    def _default_log_level(self) -> int:
        return logging.INFO

    def get_default_logging_config(self) -> dict[str, Any]:
        level = self.log_level
        if not isinstance(level, int | str):
            raise TypeError(f"log_level {level!r} is neither a number nor a name")
        return logging_config(level=level, style=LogStyle(self.log_style))

    @observe("log_style")
    def _log_style_changed(self, change: Any) -> None:
        self._configure_logging()

    def initialize(self, argv: Sequence[str] | None = None) -> None:
        self.parse_command_line(list(argv) if argv is not None else None)
        if self.config_file:
            command_line = copy.deepcopy(self.config)
            path = Path(self.config_file)
            self.load_config_file(path.name, path=str(path.parent))
            self.update_config(command_line)

    def resolved_settings(self) -> AgentSettings:
        """The traits as ``AgentSettings``; ``SettingsError`` says which one is wrong."""
        pause_at = os.environ.get(PAUSE_ENV) or None
        if pause_at is not None and pause_at not in STEPS:
            raise SettingsError(f"{PAUSE_ENV}={pause_at!r}: the steps are {', '.join(STEPS)}")
        text = {name: getattr(self, name) for name, _, _ in _declared()}
        return AgentSettings.from_text(text, TestHooks(pause_at=pause_at))

    def start(self) -> None:
        try:
            settings = self.resolved_settings()
        except SettingsError as e:
            self.log.critical("invalid configuration: %s", e)
            raise SystemExit(EXIT_FAILED) from e
        if self.show_resolved_config:
            print(json.dumps(settings.describe(), indent=2, sort_keys=True))
            return
        code = asyncio.run(_serve(settings, self.log))
        if code != EXIT_OK:
            raise SystemExit(code)


async def _serve(settings: AgentSettings, log: logging.Logger | logging.LoggerAdapter[Any]) -> int:
    """Run the agent until SIGTERM/SIGINT; the exit code."""
    from .api.server import ListenError
    from .runtime import Agent

    log.info("resolved configuration: %s", json.dumps(settings.describe(), sort_keys=True))
    if settings.hooks.pause_at is not None:
        log.warning(
            "TEST HOOK %s=%s is set: operations stop there", PAUSE_ENV, settings.hooks.pause_at
        )
    try:
        agent = await asyncio.to_thread(Agent.create, settings)
    except Exception as e:
        # Anything from a locked state dir to a missing compiler for --simulate: say what.
        log.critical("cannot start: %s", e, exc_info=log.isEnabledFor(logging.DEBUG))
        return EXIT_FAILED
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(agent.reconcile_now()))
    try:
        await agent.start()
    except ListenError as e:
        log.critical("cannot start: %s", e)
        await agent.stop()
        return EXIT_FAILED
    log.info(
        "agent ready (pid %d)%s", os.getpid(), " with SIMULATED GPUs" if settings.simulated else ""
    )
    await stop.wait()
    await agent.stop()
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the agent with ``argv`` (default ``sys.argv[1:]``); the exit code."""
    app = AgentApp()
    try:
        app.initialize(argv)
        app.start()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_FAILED
    finally:
        # A later AgentApp in this process (tests) must configure logging afresh.
        app.close_handlers()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
