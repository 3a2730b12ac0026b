"""``gyre tinker-serve``'s typed config: ``key=value`` overrides on the command line."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gyre.config.ray import RoleResources, check_custom_resources


class TinkerRayConfig(BaseModel):
    """``runner=ray``: one trainer actor and ``sampler_workers`` sampler actors."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(
        "",
        description="'' starts a local Ray cluster (or joins RAY_ADDRESS when set), 'local' always "
        "starts one; 'auto' or "
        "'ray://host:10001' joins an existing one",
    )
    num_cpus: int = Field(0, ge=0, description="logical CPUs of a local cluster; 0 detects them")
    namespace: str = Field("gyre-tinker", description="Ray namespace the actors are named in")
    sampler_workers: int = Field(
        1, ge=1, description="sampler actors, each with its own copy of the base model"
    )
    trainer: RoleResources = Field(
        default_factory=RoleResources,
        description="resources of the trainer actor (resources={tinker_trainer: 1} pins it to "
        "nodes started with that resource)",
    )
    sampler: RoleResources = Field(
        default_factory=RoleResources, description="resources of one sampler actor"
    )
    max_trainer_restarts: int = Field(
        2,
        ge=0,
        description="times Ray replaces a trainer actor that died (state not saved with "
        "save_state is lost; load_state from a save continues)",
    )
    max_sampler_restarts: int = Field(
        8, ge=0, description="times Ray replaces each sampler actor that died"
    )
    call_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="longest wait for one actor call; past it the request fails naming the actor",
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, description="longest wait for the actors to start and load the base model"
    )
    heartbeat_s: float = Field(
        60.0, gt=0, description="a long actor call logs 'waiting for ...' this often"
    )

    @model_validator(mode="after")
    def _check_roles(self) -> TinkerRayConfig:
        check_custom_resources(self, ("trainer", "sampler"))
        return self


class TinkerServeConfig(BaseModel):
    """What the Tinker-compatible server serves and where it keeps state."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(
        "",
        description="base model: a local Hugging Face folder or a hub id, read from the hub cache "
        "(empty: build the tiny model)",
    )
    model_name: str = Field(
        "",
        description="the name clients pass as base_model (default: model_path as given); "
        "model_path itself is always accepted too",
    )
    state_dir: str = Field(
        "tinker-state", description="where save_state / save_weights_for_sampler write"
    )
    device: str = Field("cpu", description="cpu, cuda, cuda:N or auto")
    seed: int = Field(0, description="seed of the tiny model and of unseeded sampling")
    lora_alpha: float = Field(
        32.0, gt=0, description="LoRA alpha of every adapter (scale alpha/rank)"
    )
    max_context: int = Field(
        4096, ge=8, description="longest prompt + completion (tokens) a request may ask for"
    )
    train_micro_tokens: int = Field(
        8192,
        ge=1,
        description="forward_backward runs datums in micro-batches of at most this many padded "
        "tokens (bounds the (B, T, vocab) log-prob memory)",
    )
    sample_max_rows: int = Field(
        64, ge=1, description="most sequences one sampling batch decodes at once"
    )
    long_poll_s: float = Field(
        10.0, gt=0, le=40, description="how long retrieve_future waits before 'try again'"
    )
    result_ttl_s: float = Field(
        3600.0, gt=0, description="finished results not retrieved by then are dropped"
    )
    session_timeout_s: float = Field(
        600.0,
        gt=0,
        description="a session without heartbeat for this long is closed and its models freed",
    )
    runner: Literal["local", "ray"] = Field(
        "local",
        description="local: training and sampling in the server's process; ray: the trainer "
        "and the samplers as Ray actors (state_dir must be a path every node shares)",
    )
    ray: TinkerRayConfig = Field(
        default_factory=TinkerRayConfig, description="runner=ray: address, actors, resources"
    )


def load_tinker_config(overrides: list[str]) -> TinkerServeConfig:
    """The config from ``key=value`` strings; a bad key or value names the key."""
    from gyre.config import ConfigError
    from gyre.config.loading import _set_dotted, _yaml_load

    data: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"'{item}' is not key=value")
        key, value = item.split("=", 1)
        if key.split(".")[0] not in TinkerServeConfig.model_fields:
            valid = ", ".join(TinkerServeConfig.model_fields)
            raise ConfigError(f"unknown key '{key}' (valid: {valid})")
        if value.startswith("{"):  # a mapping: ray.trainer.resources={tinker_trainer: 1}
            try:
                value = _yaml_load(value)
            except Exception:
                raise ConfigError(f"{key}: {value!r} is not a mapping") from None
        _set_dotted(data, key, value)
    try:
        return TinkerServeConfig.model_validate(data)
    except Exception as exc:
        errors = getattr(exc, "errors", lambda: [])()
        if errors:
            e = errors[0]
            msg = e["msg"].removeprefix("Value error, ")
            raise ConfigError(f"{'.'.join(map(str, e['loc']))}: {msg}") from None
        raise
