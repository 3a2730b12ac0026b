"""The rollout engine, weight sync and the ``perf:`` section (numeric code paths)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    SecretStr,
    field_serializer,
    model_validator,
)

from gyre.config.base import (
    REDACTED,
    Section,
)


class EngineConfig(Section):
    kind: Literal["torch", "http"] = Field(
        "torch", description="torch: in-process engine; http: OpenAI-compatible servers."
    )
    urls: list[str] = Field(
        default_factory=list, description="http: server base URLs, e.g. http://10.0.0.5:8000."
    )
    api: Literal["openai", "sglang"] = Field(
        "openai",
        description="http: openai = /v1/completions + /v1/load_lora_adapter (vLLM, gyre serve); "
        "sglang = SGLang's native /generate + /load_lora_adapter (SGLang, gyre serve; the one "
        "that sends a VLM's images: docs/vision.md).",
    )
    api_key: SecretStr = Field(
        SecretStr(""),
        description="http: bearer token for a one-off (visible in the command line); prefer the "
        "GYRE_API_KEY environment variable or engine.api_key_file. Written as '***'.",
    )
    api_key_file: str = Field(
        "", description="http: file whose first line is the bearer token (used if no key is set)."
    )
    model: str = Field("", description="http: served base model name; empty asks /v1/models.")
    timeout_s: float = Field(120.0, gt=0, description="http: per-request timeout in seconds.")
    max_retries: int = Field(
        8, ge=0, description="http: retries of one request on other servers before giving up."
    )
    health_interval_s: float = Field(
        1.0, gt=0, description="http: how often dead servers are probed to be put back."
    )
    max_concurrency: int = Field(
        64, gt=0, description="http: requests in flight at once across all servers."
    )
    sync_dir: str = Field(
        "", description="Where weights/adapters are written for engines; empty = <run.dir>/sync."
    )
    sync_every: int = Field(1, gt=0, description="Sync the engines every N policy updates.")
    sync_keep: int = Field(2, ge=1, description="Synced versions kept on disk.")
    verify_every: int = Field(
        1,
        ge=0,
        description="Sync check: after every Nth weight/adapter sync each engine scores a fixed "
        "probe sequence (prompt log-probs) and the run stops (exit 3) if it does not serve the "
        "trainer's new policy; 0 = never (docs/operations.md, 'Sync verification').",
    )
    verify_tolerance: float = Field(
        0.05,
        gt=0,
        description="Sync check: largest mean |engine - trainer| log-prob per probe token, in "
        "nats (fp32 engines agree to ~1e-6; raise it for a bf16 engine against an fp32 trainer).",
    )
    verify_tokens: int = Field(
        64, ge=8, le=4096, description="Sync check: length of the probe sequence in tokens."
    )
    weight_sync: Literal["memory", "disk", "shared"] = Field(
        "memory",
        description="torch engine only: copy tensors in memory, go through sync_dir files, or "
        "shared: the engine samples from the trainer's own parameters (zero-copy; needs "
        "sync_every=1 and no LoRA). http engines always use disk.",
    )

    @field_serializer("api_key", when_used="json")
    def _redact(self, v: SecretStr) -> str:
        return REDACTED if v.get_secret_value() else ""

    @model_validator(mode="after")
    def _need_urls(self) -> EngineConfig:
        if self.kind == "http" and not self.urls:
            raise ValueError("engine.urls must list at least one server when engine.kind=http")
        if self.weight_sync == "shared":
            if self.kind != "torch":
                raise ValueError("engine.weight_sync=shared needs engine.kind=torch")
            if self.sync_every != 1:
                raise ValueError(
                    f"engine.weight_sync=shared samples from the trainer's current weights: it "
                    f"needs engine.sync_every=1 (got {self.sync_every}); use memory to lag"
                )
        return self


class PerfConfig(Section):
    """Speed switches of the trainer's scoring and the torch engine (docs/performance.md).

    The defaults are the fast paths. Each switch exists to measure what it buys; results agree
    with the plain paths to float tolerance, but float order (and so a long run's trajectory)
    may change, which is why these keys are part of the resume config hash.
    """

    train_lean_forward: bool = Field(
        True,
        description="Trainer scoring through the lean forward for Llama/Mistral/Qwen2 "
        "(gyre.models.lean); false = the HF forward.",
    )
    engine_lean_forward: bool = Field(
        True,
        description="torch engine: prefill/decode through the lean forward for Llama/Mistral/"
        "Qwen2; false = the HF forward.",
    )
    pack: bool = Field(
        True,
        description="Trainer: pack short trajectories into shared rows (first-fit decreasing) "
        "when that saves >10 % of positions.",
    )
    logprob_chunk: int = Field(
        1024,
        ge=0,
        description="Trainer: positions per LM-head/log-softmax chunk (checkpointed); 0 = all "
        "at once (with pack=false: the plain full-logits path).",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Trainer: keep only each decoder layer's input in forward and recompute "
        "the layer in backward (less activation memory, about a third more forward compute).",
    )
    share_prefix: bool = Field(
        True,
        description="Trainer: tree-pack rows sharing a prefix (a group's prompt) so it is "
        "computed once in forward and backward; needs train_lean_forward.",
    )
    score_trim: bool = Field(
        True,
        description="Trainer: feed only the positions a scored token needs (no row's last "
        "token, nothing after its last action); false = whole rows.",
    )
    shared_prefix_attention: bool = Field(
        True,
        description="torch engine, lean forward: decode attends a forked group's prompt once "
        "per group (grouped layout / cascade); false = per-row attention.",
    )
    prefix_sharing: bool = Field(
        True,
        description="torch engine: identical prompts admitted together are prefilled once and "
        "the KV cache is forked.",
    )
    compaction: bool = Field(
        True,
        description="torch engine: finished rows leave the decode batch; false = a static "
        "batch that decodes padding until every row is done.",
    )
    compact_min: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="torch engine: fraction of finished rows at which compaction gathers the "
        "live rows (0 = at every finish).",
    )
    compile_decode: bool = Field(
        False,
        description="torch engine: run the one-token decode step through torch.compile "
        "(minutes of compilation on a small CPU).",
    )
    continuous: bool = Field(
        True,
        description="Rollout: continuous batching (a finished turn's next request joins the "
        "running batch); false = turns in lockstep.",
    )
