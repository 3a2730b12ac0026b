"""The Tinker service's backend seam, without Ray or a model: training work goes to the
backend's ``train`` object and sampling to its ``sample`` object, each on its own lane of the
future queue (as ``runner=ray`` sets them up); and the ``runner`` / ``ray.*`` keys."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from gyre.config import ConfigError
from gyre.tinker.config import TinkerServeConfig, load_tinker_config
from gyre.tinker.service import Backend, TinkerService
from gyre.tinker.tenants import ModelCard
from gyre.tinker.wire import FwdBwdCall


class Trainer:
    """Records the training calls; forward_backward waits for ``gate``."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.gate = threading.Event()

    def create_model(self, model_id, session_id, spec) -> None:
        self.calls.append(("create_model", model_id, spec.rank))

    def forward_backward(self, call, custom) -> bytes:
        self.gate.wait(10)
        self.calls.append(("forward_backward", call.model_id))
        return b"fb"

    def optim_step(self, model_id, adam) -> dict:
        self.calls.append(("optim_step", model_id, adam["learning_rate"]))
        return {"metrics": {}}


class Sampler:
    def sample(self, folder, jobs) -> list[bytes]:
        return [f"{folder}:{job.n}x{job.params.max_new_tokens}".encode() for job in jobs]


def test_training_and_sampling_run_on_their_own_lanes_in_order(tmp_path):
    tok = SimpleNamespace(eos_token_id=0, pad_token_id=0)
    card = ModelCard(tok, "tiny", str(tmp_path), 1.0, arch=("Tiny", 50))
    trainer = Trainer()
    lanes = {"train": 1, "sample": 2}
    backend = Backend(card, trainer, Sampler(), lanes, "train", "sample")
    service = TinkerService(TinkerServeConfig(state_dir=str(tmp_path / "state")), backend)
    try:
        sid = service.create_session({})["session_id"]
        body = {"session_id": sid, "model_seq_id": 0, "base_model": "tiny"}
        rid = service.create_model({**body, "lora_config": {"rank": 4}})
        model_id = service.futures.wait(rid, 5).payload["model_id"]
        fb = service.forward_backward(FwdBwdCall(model_id, 1, "cross_entropy", {}, False, []))
        opt = service.optim_step({"model_id": model_id, "adam_params": {"learning_rate": 0.5}})
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
        sample, seq_ids = service.samplers.asample(
            {"prompt": prompt, "base_model": "tiny", "num_samples": 2, "sampling_params": {}}
        )
        # the trainer is held inside forward_backward: sampling still answers, training waits
        assert service.futures.wait(sample, 5).payload == b"None:2x128"
        assert len(seq_ids) == 2
        assert service.futures.wait(opt, 0.2) is None
        trainer.gate.set()
        assert service.futures.wait(fb, 5).payload == b"fb"
        assert service.futures.wait(opt, 5).payload == {"metrics": {}}
        assert trainer.calls == [
            ("create_model", model_id, 4),
            ("forward_backward", model_id),
            ("optim_step", model_id, 0.5),
        ]
    finally:
        service.close()


def test_ray_keys_from_the_command_line_name_the_key_when_bad():
    cfg = load_tinker_config(
        [
            "runner=ray",
            "ray.sampler_workers=2",
            "ray.trainer.resources={tinker_trainer: 1}",
            "ray.sampler.num_cpus=0.5",
        ]
    )
    assert cfg.runner == "ray" and cfg.ray.sampler_workers == 2
    assert cfg.ray.trainer.resources == {"tinker_trainer": 1.0}
    assert cfg.ray.sampler.num_cpus == 0.5 and cfg.ray.address == ""
    with pytest.raises(ConfigError, match=r"ray\.sampler_workers"):
        load_tinker_config(["ray.sampler_workers=0"])
    with pytest.raises(ConfigError, match=r"ray\.trainer\.resources: 'CPU: 1'"):
        load_tinker_config(["ray.trainer.resources={CPU: 1}"])
    with pytest.raises(ConfigError, match="runner"):
        load_tinker_config(["runner=k8s"])
    with pytest.raises(ConfigError, match=r"ray\.nope"):
        load_tinker_config(["ray.nope=1"])
