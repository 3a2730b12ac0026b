"""Shared fixtures: one torch thread, offline Hugging Face, tiny models built on the spot."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))  # for `import helpers`

TINY_DIMS = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The CPU is shared: every test runs torch on one thread (gyre.loop.setup may change it)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    from gyre.models.build import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_cfg():
    """The model config of every tiny test model (2 layers, hidden 32)."""
    from gyre.config import ModelConfig

    return ModelConfig(**TINY_DIMS)


@pytest.fixture(scope="session")
def make_tiny_model(tokenizer) -> Callable[..., torch.nn.Module]:
    """``make_tiny_model(seed=0, sharp=False)``: a 2-layer, 32-wide Llama in eval mode.

    ``sharp=True`` redraws every matrix with std 0.5 so the next-token distribution is peaked
    (entropy ~2 nats instead of ~ln(vocab)), which makes logprob and top-p checks meaningful.
    """
    from gyre.config import ModelConfig
    from gyre.models.build import build_tiny_model

    def make(seed: int = 0, sharp: bool = False) -> torch.nn.Module:
        model = build_tiny_model(ModelConfig(**TINY_DIMS), tokenizer, seed)
        if sharp:
            g = torch.Generator().manual_seed(seed + 12345)
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 2:
                        p.normal_(0.0, 0.5, generator=g)
        return model.eval()

    return make


def pytest_collection_modifyitems(config, items) -> None:
    """``@pytest.mark.slow`` tests run only with GYRE_SLOW=1 (pyproject's marker promise)."""
    if os.environ.get("GYRE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set GYRE_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
