"""``gyre serve --record DIR``: chat calls of an agent gyre did not write, recorded as episodes.

An agent (any program speaking the OpenAI chat API, tools included) names its episode with a
session id -- the ``X-Gyre-Session`` header or the ``gyre_session`` body field -- and its task
with ``X-Gyre-Group`` / ``gyre_group`` (the episodes of one task form a GRPO group). Every call
of a session is recorded token-in/token-out:

- **The first call** is rendered by the model's chat template (with the request's ``tools``),
  exactly as an unrecorded call; those ids start the episode (loss mask 0).
- **The sampled ids** are appended as sampled, with their logprobs (loss mask 1), and never
  re-tokenised. The server stops at the template's end-of-turn token as well as at EOS.
- **A later call** whose messages extend the session's conversation -- the earlier messages,
  then the assistant message this server returned (content and tool calls compared, call ids
  ignored), then new messages -- is *spliced*: the engine is asked with the episode's ids so
  far plus the template's rendering of the new messages only
  (:meth:`gyre.rollout.chat.ChatEpisode.observe`, the glue after the end-of-turn token
  included). So what the model sees is what it wrote, and the recording is one sequence.
- **Re-rendering drift.** Where the template's own rendering of the agent's messages differs
  from the spliced text (a tool call re-serialised with other whitespace, a template that drops
  earlier ``<think>`` blocks), the call is counted (``rerender_drift_calls`` of the episode,
  ``/v1/gyre/recording``); the spliced ids are still what the model is asked with and what
  is trained.
- **A rewrite**: messages that do not extend the conversation (the agent edited or summarised
  its history, or changed ``tools``) close the episode's current segment and start a new one
  from the template's rendering; such an episode trains as step-wise rows, one per segment.

An episode ends with ``POST /v1/gyre/episodes/{session}/reward {"reward": r}`` (the agent
scores itself) or ``POST /v1/gyre/episodes/{session}/end`` (the ``--reward-fn`` callback,
``fn(messages, metadata) -> float``, scores the conversation); it is then appended to
``DIR/episodes.jsonl`` in the schema of :mod:`gyre.rollout.recorded`. Calls without a session
id are served and not recorded. One call at a time per session (a concurrent one is a 409).
All recorder state is touched only on the server's preparation thread.

An agent that crashes leaves its episode open. ``DELETE /v1/gyre/episodes/{session}`` abandons
one explicitly; ``--session-timeout SECONDS`` (default 3600, 0 = never) ends every episode idle
that long, checked at each call: scored by ``--reward-fn`` and recorded where there is one,
else dropped. Abandoned episodes are counted (``abandoned_episodes`` in
``/v1/gyre/recording``) and named on stderr, so the server's memory stays bounded.
"""

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from gyre.rollout.chat import ChatEpisode, ChatTemplate
from gyre.rollout.recorded import RECORD_FILE, RECORD_SCHEMA
from gyre.serve.requests import (
    ApiError,
    ChatBody,
    chat_answer,
    check_length,
    message_dict,
    sampling_params,
    validation_message,
)
from gyre.types import Completion, GenerationRequest, SamplingParams

Message = dict[str, Any]
RewardFn = Callable[[list[Message], dict[str, Any]], Any]


def _norm(m: Message) -> tuple[Any, ...]:
    """A message as the splice compares it: role, content ('' for None), name, tool call id,
    and each tool call's name and parsed arguments (call ids are the agent's to echo)."""
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", c) if isinstance(c, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    content = m.get("content") or ""
    return (m.get("role"), content, m.get("name"), m.get("tool_call_id"), tuple(calls))


@dataclass
class Segment:
    """One token sequence of an episode (a rewrite starts another)."""

    ep: ChatEpisode
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)

    def add(self, ids: list[int], sampled: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [1 if sampled is not None else 0] * len(ids)
        self.logprobs += list(sampled) if sampled is not None else [0.0] * len(ids)

    def as_record(self) -> dict[str, Any]:
        return {
            "token_ids": self.ids,
            "loss_mask": self.mask,
            "rollout_logprobs": self.logprobs,
            "turn_spans": [list(s) for s in self.spans],
            "template_drift": self.ep.drift,
        }


@dataclass
class _Pending:
    ep: ChatEpisode
    new_segment: bool
    append: list[int]
    messages: list[Message]
    drift: bool
    params: SamplingParams


@dataclass
class Session:
    key: str
    group: str
    metadata: dict[str, Any]
    tools_key: str
    segments: list[Segment] = field(default_factory=list)
    sent: list[Message] = field(default_factory=list)  # the agent's view, our last reply included
    calls: int = 0
    drift_calls: int = 0
    rewrites: int = 0
    tool_calls: int = 0
    malformed: int = 0
    truncated: bool = False
    sampling: set[tuple[float, float]] = field(default_factory=set)
    versions: set[int] = field(default_factory=set)
    pending: _Pending | None = None
    started: float = field(default_factory=time.time)
    active: float = field(default_factory=time.monotonic)  # the last call's end (idle timeout)

    def summary(self) -> dict[str, Any]:
        return {
            "session": self.key,
            "group": self.group,
            "calls": self.calls,
            "segments": len(self.segments),
            "tokens": sum(len(s.ids) for s in self.segments),
            "sampled_tokens": sum(sum(s.mask) for s in self.segments),
            "rerender_drift_calls": self.drift_calls,
            "rewrites": self.rewrites,
            "tool_calls": self.tool_calls,
            "malformed_tool_calls": self.malformed,
        }


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | None = None
    success: bool | None = None


def session_of(headers: Any, body: ChatBody) -> tuple[str, str] | None:
    """(session, group) of a chat call from its headers or body; None: not to be recorded."""
    pairs = []
    for header, value in (("x-gyre-session", body.gyre_session), ("x-gyre-group", body.gyre_group)):
        got = headers.get(header)
        if got is not None and value is not None and got != value:
            field_name = "gyre_" + header.split("-")[-1]
            raise ApiError(400, f"{header} header and {field_name} differ", field_name)
        pairs.append(got if got is not None else value)
    session, group = pairs
    if session is None:
        return None
    if not session or len(session) > 256:
        raise ApiError(400, "a session id is 1 to 256 characters", "gyre_session")
    return session, group or session


class Recorder:
    """Sessions in flight and the recording file (see the module docstring)."""

    def __init__(
        self,
        out_dir: str | Path,
        tokenizer: Any,
        reward_fn: RewardFn | None = None,
        idle_timeout_s: float = 3600.0,
    ):
        if not idle_timeout_s >= 0:
            raise ValueError(f"--session-timeout must be >= 0 seconds, got {idle_timeout_s}")
        self.idle_timeout_s = idle_timeout_s
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / RECORD_FILE
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.sessions: dict[str, Session] = {}
        self._templates: dict[str, ChatTemplate] = {}
        self.stats = {
            "episodes": 0,
            "calls": 0,
            "unrecorded_calls": 0,
            "rerender_drift_calls": 0,
            "rewrites": 0,
            "malformed_tool_calls": 0,
            "abandoned_episodes": 0,
        }

    def template(self, tools: list[dict[str, Any]] | None, key: str) -> ChatTemplate:
        if key not in self._templates:
            try:
                self._templates[key] = ChatTemplate(self.tokenizer, tools)
            except ValueError as exc:
                raise ApiError(400, f"gyre serve --record: {exc}", "messages") from exc
        return self._templates[key]

    # -- a call: begin (prompt ids) -> the engine -> commit (record) or abort ------------------
    def begin(
        self, host: Any, key: str, group: str, body: ChatBody
    ) -> tuple[str, list[GenerationRequest], SamplingParams]:
        self.expire()
        model = host.check_model(body.model)
        if body.stream:
            raise ApiError(400, "stream=true is not supported by gyre serve", "stream")
        if body.n != 1:
            raise ApiError(400, "a recorded call samples one reply (n=1)", "n")
        k = body.top_logprobs or 0
        if k and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        s = self.sessions.get(key)
        if s is not None and s.pending is not None:
            raise ApiError(409, f"session {key!r} already has a call in flight", "gyre_session")
        if s is not None and group != s.group and body.gyre_group is not None:
            raise ApiError(400, f"session {key!r} belongs to group {s.group!r}", "gyre_group")
        msgs = [message_dict(m) for m in body.messages]
        tools_key = json.dumps(body.tools, sort_keys=True)
        tpl = self.template(body.tools, tools_key)
        try:
            ep, new, append = self._splice(s, msgs, tpl, tools_key)
            drift = ep.text != tpl.render(msgs, True)
        except Exception as exc:  # jinja2's TemplateError, or a template's raise_exception
            raise ApiError(
                400, f"the model's chat template refused the messages: {exc}", "messages"
            ) from exc
        max_new = body.max_completion_tokens or body.max_tokens or 64
        params = sampling_params(host.vocab, body, max_new, k)
        if params.top_k:  # the trainer scores recorded tokens without one
            raise ApiError(
                400, "top_k: not allowed on a recorded call (train.sampling has none)", "top_k"
            )
        stops = tuple(sorted({*params.stop_token_ids, *tpl.stop_ids()}))
        params = replace(params, stop_token_ids=stops)
        prompt = (s.segments[-1].ids if (s is not None and not new) else []) + append
        check_length(host.vocab, prompt, params.max_new_tokens)
        if s is None:
            s = self.sessions[key] = Session(key, group, {}, tools_key)
        s.metadata.update(body.gyre_metadata or {})
        s.pending = _Pending(ep, new, append, msgs, drift, params)
        return model, [GenerationRequest(prompt)], params

    def _splice(
        self, s: Session | None, msgs: list[Message], tpl: ChatTemplate, tools_key: str
    ) -> tuple[ChatEpisode, bool, list[int]]:
        """(the episode state after this call's messages, whether it is a new segment, the ids
        to append): the new messages' rendering when ``msgs`` extends the session's
        conversation, else a fresh rendering of ``msgs``."""
        if s is not None and s.tools_key == tools_key and len(msgs) > len(s.sent):
            if [_norm(m) for m in msgs[: len(s.sent)]] == [_norm(m) for m in s.sent]:
                old = s.segments[-1].ep
                ep = replace(old, conv=list(old.conv), steps=list(old.steps))
                return ep, False, ep.observe(msgs[len(s.sent) :])
        ep = ChatEpisode(tpl)
        return ep, True, ep.start(msgs)

    def commit(
        self,
        host: Any,
        key: str,
        model: str,
        body: ChatBody,
        reqs: list[GenerationRequest],
        outs: list[Completion],
    ) -> dict[str, Any]:
        s = self.sessions[key]
        p, out = s.pending, outs[0]
        assert p is not None
        if p.new_segment:
            if s.segments:  # a rewrite: the old segment gets its closing glue and stays
                s.segments[-1].add(s.segments[-1].ep.close())
                s.rewrites += 1
                self.stats["rewrites"] += 1
            s.segments.append(Segment(p.ep))
        seg = s.segments[-1]
        seg.ep = p.ep
        seg.add(p.append)
        start = len(seg.ids)
        seg.add(list(out.token_ids), list(out.logprobs))
        seg.spans.append((start, len(seg.ids)))
        p.ep.reply(out)
        answer = chat_answer(host.vocab, model, body, reqs, outs)
        reply = answer["choices"][0]["message"]
        text = host.vocab.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        malformed = "<tool_call>" in text and not reply.get("tool_calls") and bool(body.tools)
        s.sent = [*p.messages, reply]
        s.calls += 1
        s.drift_calls += int(p.drift)
        s.tool_calls += len(reply.get("tool_calls") or [])
        s.malformed += int(malformed)
        s.truncated = out.finish_reason == "length"
        s.sampling.add((p.params.temperature, p.params.top_p))
        s.versions.add(int(host.engine.version))
        s.pending = None
        s.active = time.monotonic()
        self.stats["calls"] += 1
        self.stats["rerender_drift_calls"] += int(p.drift)
        self.stats["malformed_tool_calls"] += int(malformed)
        answer["gyre"] = {**s.summary(), "rerender_drift": p.drift}
        return answer

    def abort(self, key: str) -> None:
        s = self.sessions.get(key)
        if s is not None:
            s.pending = None
            if not s.segments:
                del self.sessions[key]

    # -- the end of an episode -----------------------------------------------------------------
    def expire(self, now: float | None = None) -> list[str]:
        """End the episodes idle for over ``idle_timeout_s`` (none in flight): recorded with
        ``--reward-fn``'s score where there is one, else dropped. Returns their sessions."""
        if not self.idle_timeout_s:
            return []
        now = time.monotonic() if now is None else now
        idle = [
            k
            for k, s in self.sessions.items()
            if s.pending is None and now - s.active > self.idle_timeout_s
        ]
        for key in idle:
            why = f"idle for over {self.idle_timeout_s:g} s"
            if self.reward_fn is not None:
                try:
                    self.finish(key, None, None)
                    print(
                        f"gyre serve --record: episode {key!r} {why}: ended, scored by --reward-fn",
                        file=sys.stderr,
                    )
                    continue
                except ApiError as exc:
                    why += f" (--reward-fn: {exc.message})"
            self.abandon(key, why)
        return idle

    def abandon(self, key: str, why: str = "abandoned by the agent") -> dict[str, Any]:
        """Drop an open episode unrecorded (``DELETE /v1/gyre/episodes/{session}``)."""
        s = self.sessions.get(key)
        if s is None:
            raise ApiError(404, f"no open episode {key!r} (never called, or already ended)")
        if s.pending is not None:
            raise ApiError(409, f"session {key!r} has a call in flight", "gyre_session")
        del self.sessions[key]
        self.stats["abandoned_episodes"] += 1
        print(f"gyre serve --record: episode {key!r} {why}: dropped, not recorded", file=sys.stderr)
        return {"abandoned": True, **s.summary()}

    def finish(self, key: str, reward: float | None, success: bool | None) -> dict[str, Any]:
        s = self.sessions.get(key)
        if s is None:
            raise ApiError(404, f"no open episode {key!r} (never called, or already ended)")
        if s.pending is not None:
            raise ApiError(409, f"session {key!r} has a call in flight", "gyre_session")
        if reward is None:
            reward, success = self._score(s, success)
        if not math.isfinite(reward):
            raise ApiError(400, f"reward must be finite, got {reward}", "reward")
        del self.sessions[key]
        for seg in s.segments[-1:]:
            seg.add(seg.ep.close())
        rec = self._record(s, reward, success)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.stats["episodes"] += 1
        return {"written": str(self.path), "reward": reward, **s.summary()}

    def _score(self, s: Session, success: bool | None) -> tuple[float, bool | None]:
        if self.reward_fn is None:
            raise ApiError(
                400,
                'no reward given and gyre serve has no --reward-fn: post {"reward": r} '
                "to /v1/gyre/episodes/{session}/reward",
                "reward",
            )
        try:
            got = self.reward_fn([dict(m) for m in s.sent], dict(s.metadata))
        except Exception as exc:  # the user's callback: its error goes back, the episode stays
            raise ApiError(500, f"--reward-fn raised {type(exc).__name__}: {exc}") from exc
        if isinstance(got, tuple):
            got, success = got
        try:
            return float(got), success
        except (TypeError, ValueError):
            raise ApiError(500, f"--reward-fn returned {got!r}, not a number") from None

    def _record(self, s: Session, reward: float, success: bool | None) -> dict[str, Any]:
        (temp, top_p), *others = sorted(s.sampling)
        if others:  # several temperatures in one episode: no single distribution to train at
            temp = top_p = None  # type: ignore[assignment]
        return {
            "schema": RECORD_SCHEMA,
            "session": s.key,
            "group": s.group,
            "reward": reward,
            "success": bool(reward > 0) if success is None else success,
            "policy_version": min(s.versions),
            "policy_versions": sorted(s.versions),
            "temperature": temp,
            "top_p": top_p,
            "num_calls": s.calls,
            "truncated": s.truncated,
            "template_drift": any(g.ep.drift for g in s.segments),
            "rerender_drift_calls": s.drift_calls,
            "rewrites": s.rewrites,
            "tool_calls": s.tool_calls,
            "malformed_tool_calls": s.malformed,
            "metadata": s.metadata,
            "messages": s.sent,
            "started": s.started,
            "ended": time.time(),
            "segments": [g.as_record() for g in s.segments],
        }

    def close(self) -> None:
        """At shutdown: score open episodes with ``--reward-fn`` (else say they are lost)."""
        open_ = [k for k, s in self.sessions.items() if s.pending is None]
        if self.reward_fn is None:
            if open_:
                print(
                    f"gyre serve --record: {len(open_)} episode(s) never got a reward and "
                    "are not recorded",
                    file=sys.stderr,
                )
            return
        for key in open_:
            try:
                self.finish(key, None, None)
            except ApiError as exc:
                print(f"gyre serve --record: episode {key!r}: {exc.message}", file=sys.stderr)


def add_recorder_args(add: Callable[..., Any]) -> None:
    """``gyre serve``'s recording flags (``add`` is the parser's ``add_argument``)."""
    add(
        "--record",
        default="",
        metavar="DIR",
        help="record chat calls that name a session (X-Gyre-Session) as episodes in "
        "DIR/episodes.jsonl, for gyre train train.source=DIR (docs/envs.md)",
    )
    add(
        "--reward-fn",
        default="",
        metavar="FILE.py:FN",
        help="with --record: fn(messages, metadata) -> reward, called when an episode ends "
        "without a posted reward (module:fn also works)",
    )
    add(
        "--session-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="with --record: end an episode idle this long (scored by --reward-fn if given, "
        "else dropped and counted); 0 keeps idle episodes forever (default 3600)",
    )


def build_recorder(
    record: str, reward_fn: str, tokenizer: Any, idle_timeout_s: float = 3600.0
) -> Recorder | None:
    """``--record DIR`` / ``--reward-fn FILE.py:FN`` (or ``module:fn``) -> the recorder."""
    if not record:
        if reward_fn:
            raise ValueError("--reward-fn needs --record DIR")
        return None
    from gyre.plugins import load_object

    fn = load_object(reward_fn, "--reward-fn") if reward_fn else None
    if fn is not None and not callable(fn):
        raise ValueError(f"--reward-fn {reward_fn} is not callable")
    return Recorder(record, tokenizer, fn, idle_timeout_s)


def _body(raw: bytes) -> RewardBody:
    try:
        return RewardBody.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise ApiError(400, *validation_message(list(exc.errors(include_url=False)))) from None


async def recorded_chat(
    host: Any, batcher: Any, rec: Recorder, session: tuple[str, str], body: ChatBody
) -> dict[str, Any]:
    """A chat call of a session: spliced prompt, one engine call, recorded reply."""
    key, group = session
    model, reqs, params = await batcher.run_in_prep(rec.begin, host, key, group, body)
    try:
        outs = await batcher.submit(model, reqs, params)
    except BaseException:
        await batcher.run_in_prep(rec.abort, key)
        raise
    return await batcher.run_in_prep(rec.commit, host, key, model, body, reqs, outs)


def add_routes(app: Any, batcher: Any, auth: list[Any], rec: Recorder) -> None:
    """``/v1/gyre/episodes/{session}/reward|end``, ``GET`` / ``DELETE
    /v1/gyre/episodes/{session}`` and ``GET /v1/gyre/recording``."""
    from fastapi import Request

    @app.post("/v1/gyre/episodes/{session}/reward", dependencies=auth)
    async def reward(session: str, request: Request) -> Any:
        body = _body(await request.body())
        if body.reward is None:
            raise ApiError(
                400, "reward is required here (or POST .../end for --reward-fn)", "reward"
            )
        return await batcher.run_in_prep(rec.finish, session, body.reward, body.success)

    @app.post("/v1/gyre/episodes/{session}/end", dependencies=auth)
    async def end(session: str, request: Request) -> Any:
        body = _body(await request.body())
        return await batcher.run_in_prep(rec.finish, session, body.reward, body.success)

    @app.delete("/v1/gyre/episodes/{session}", dependencies=auth)
    async def drop(session: str) -> Any:
        return await batcher.run_in_prep(rec.abandon, session)

    @app.get("/v1/gyre/episodes/{session}", dependencies=auth)
    async def episode(session: str) -> Any:
        s = rec.sessions.get(session)
        if s is None:
            raise ApiError(404, f"no open episode {session!r}")
        return s.summary()

    @app.get("/v1/gyre/recording", dependencies=auth)
    async def recording() -> Any:
        return {"path": str(rec.path), "open_episodes": len(rec.sessions), **rec.stats}
