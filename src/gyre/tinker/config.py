"""``gyre tinker-serve``'s typed config: ``key=value`` overrides on the command line."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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


def load_tinker_config(overrides: list[str]) -> TinkerServeConfig:
    """The config from ``key=value`` strings; a bad key or value names the key."""
    from gyre.config import ConfigError

    data: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"'{item}' is not key=value")
        key, value = item.split("=", 1)
        if key not in TinkerServeConfig.model_fields:
            valid = ", ".join(TinkerServeConfig.model_fields)
            raise ConfigError(f"unknown key '{key}' (valid: {valid})")
        data[key] = value
    try:
        return TinkerServeConfig.model_validate(data)
    except Exception as exc:
        errors = getattr(exc, "errors", lambda: [])()
        if errors:
            e = errors[0]
            raise ConfigError(f"{'.'.join(map(str, e['loc']))}: {e['msg']}") from None
        raise
