"""The table of rollout engines: one :class:`EngineSpec` per ``rollout.engine`` value, what the
config's validation and :func:`megatron_klear.rollout.factory.make_engine` read. Adding an engine is
one :func:`register_engine` call here (or in the user's own module, before the job's config is
read) plus its own module, whose builder takes the ``rollout`` section and the job's context
(``model_dir``, ``device``, ``hf_config``, ``routed_experts``, ``weight_sync``) and returns a
:class:`~megatron_klear.rollout.base.RolloutEngine`.

The builder is named, not imported (``"package.module:Class.method"``): this table sits at the
bottom of the package, under every engine, and importing one engine never imports the others
(vLLM and SGLang are optional extras)."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field

from megatron_klear.platform.errors import ConfigError


def _needs_urls(what: str):
    def check(r) -> None:
        if not r.urls:
            raise ConfigError(f"rollout.engine={r.engine} needs rollout.urls ({what})")

    return check


def _sglang_checks(r) -> None:
    _needs_urls("SGLang server or router URLs")(r)


def _vllm_checks(r) -> None:
    _needs_urls("the vLLM servers' URLs")(r)
    if r.router_replay:
        raise ConfigError(
            "rollout.router_replay with rollout.engine=vllm: this client does not read vLLM's routed "
            "experts yet; use SGLang servers (rollout.engine=sglang) or the embedded engine"
        )


@dataclass(frozen=True)
class EngineSpec:
    """One engine: ``name`` (the ``rollout.engine`` value), ``builder`` (``"module:attribute"``, imported
    when the engine is built, or the callable itself; called as ``builder(rollout_section,
    **context)``), ``servers`` (rollout servers reached over HTTP, a
    :class:`~megatron_klear.rollout.base.ServerEngine`, rather than an engine in the trainer's
    process), ``check`` (the section's checks this engine needs, raising
    :class:`~megatron_klear.platform.errors.ConfigError` naming the key), ``aliases`` (older names,
    accepted with a notice naming this one), ``summary`` (one line for messages and docs)."""

    name: str
    builder: object
    servers: bool
    summary: str
    check: object = None
    aliases: tuple = field(default_factory=tuple)

    def build(self, r, **context):
        if callable(self.builder):
            return self.builder(r, **context)
        module, _, attr = self.builder.partition(":")
        target = importlib.import_module(module)
        for part in attr.split("."):
            target = getattr(target, part)
        return target(r, **context)


ENGINES: dict = {}


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add ``spec`` to the table (its name and aliases must be new)."""
    taken = [n for n in (spec.name, *spec.aliases) if n in ENGINES or any(n in s.aliases for s in ENGINES.values())]
    if taken:
        raise ValueError(f"rollout engine names already registered: {taken}")
    ENGINES[spec.name] = spec
    return spec


def engine_spec(name: str) -> EngineSpec:
    """The spec of ``rollout.engine=name`` (an alias is answered with its engine and a one-line
    notice); an unknown name raises :class:`ConfigError` listing the registered ones."""
    if name in ENGINES:
        return ENGINES[name]
    for spec in ENGINES.values():
        if name in spec.aliases:
            print(f"notice: rollout.engine={name} is now rollout.engine={spec.name}", file=sys.stderr, flush=True)
            return spec
    known = ", ".join(f"{s.name} ({s.summary})" for s in ENGINES.values())
    raise ConfigError(f"rollout.engine must be one of: {known}; got {name!r}")


register_engine(
    EngineSpec(
        "embedded",
        "megatron_klear.rollout.embedded.engine:EmbeddedEngine.from_rollout_config",
        servers=False,
        summary="the torch engine in the trainer's driver process",
    )
)
register_engine(
    EngineSpec(
        "sglang",
        "megatron_klear.rollout.sglang.engine:SGLangEngine.from_rollout_config",
        servers=True,
        summary="SGLang servers, directly or behind sglang-router",
        check=_sglang_checks,
        aliases=("http",),
    )
)
register_engine(
    EngineSpec(
        "vllm",
        "megatron_klear.rollout.vllm.engine:VLLMEngine.from_rollout_config",
        servers=True,
        summary="vLLM servers",
        check=_vllm_checks,
    )
)
