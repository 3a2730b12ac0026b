"""``gyre serve --record DIR --reward-fn examples/agent-proxy/reward.py:score``: the server
scores an episode when the agent ends it (``POST /v1/gyre/episodes/{session}/end``), from the
conversation and the task the agent sent as ``gyre_metadata`` (``agent.py --server-reward``).
"""

from __future__ import annotations

from typing import Any


def score(messages: list[dict[str, Any]], metadata: dict[str, Any]) -> tuple[float, bool]:
    """(reward, success): reasoning-gym's own scorer on the final reply when the task is one of
    its entries, else an exact match with ``metadata["answer"]``."""
    reply = (messages[-1].get("content") or "").strip() if messages else ""
    entry = metadata.get("entry")
    if entry:
        import reasoning_gym

        ds = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0)
        reward = float(ds.score_answer(reply, entry))
    else:
        reward = float(reply == str(metadata.get("answer")))
    return reward, reward >= 1.0
