"""The official ``tinker`` SDK, unmodified: uploaded custom losses, the sampling options, and a
base model named by its hub id, against ``gyre tinker-serve`` on tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tinker_helpers import start_in_process  # noqa: E402

KEY = "tml-local-test"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    local = start_in_process(tmp_path_factory.mktemp("tinker-state"))
    sc = tinker.ServiceClient(base_url=local.url, api_key=KEY)
    yield sc
    sc.close("success").result()
    local.stop()


def _base(sc) -> str:
    return sc.get_server_capabilities().supported_models[0].model_name


def _data(tok) -> list[types.Datum]:
    out = []
    for text in ("2+2=4", "3+3=6"):
        full = tok.encode(text, add_special_tokens=False)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": [0.5] * (len(full) - 1)},
            )
        )
    return out


def weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss.detach(), "custom/w:mean": weights.mean()}


def test_an_uploaded_custom_loss_trains_exactly_like_its_builtin_twin(client):
    handle = client.create_custom_loss(weighted_nll, {"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id  # uploaded: it runs on the server, in one forward_backward
    base = _base(client)
    a = client.create_lora_training_client(base_model=base, rank=4, seed=11).result()
    b = client.create_lora_training_client(base_model=base, rank=4, seed=11).result()
    data = _data(a.get_tokenizer())
    for _ in range(2):
        got = a.forward_backward_custom(data, handle).result()
        a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        want = b.forward_backward(data, "cross_entropy").result()
        b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
        assert got.metrics["custom/nll:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
        assert got.metrics["custom/w:mean"] == pytest.approx(0.5)
    after = [np.asarray(o["logprobs"].data) for o in a.forward(data, "cross_entropy").result()
             .loss_fn_outputs]  # fmt: skip
    twin = [np.asarray(o["logprobs"].data) for o in b.forward(data, "cross_entropy").result()
            .loss_fn_outputs]  # fmt: skip
    for x, y in zip(after, twin, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_custom_loss_outside_the_servers_allow_list_is_refused_naming_it(client):
    def histogram(logprobs, weights):
        return -(torch.histc(logprobs, bins=4) * 0).sum() - (logprobs * weights).sum(), {}

    with pytest.raises(Exception, match=r"'torch\.histc' is not allowed"):
        client.create_custom_loss(histogram, {"logprobs": 1, "weights": 1}).result()


def test_topk_logprobs_of_samples_and_of_a_prompt_suffix(client):
    tc = client.create_lora_training_client(base_model=_base(client), rank=4).result()
    tok = tc.get_tokenizer()
    sampler = client.create_sampling_client(base_model=_base(client))
    prompt = tok.encode("hello there", add_special_tokens=False)
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=5, seed=3, stop=[]),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
        prompt_logprobs_last_n=4,
    ).result()
    full = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    cut = len(prompt) - 4
    assert res.prompt_logprobs[:cut] == [None] * cut
    assert res.prompt_logprobs[cut:] == pytest.approx(full[cut:], abs=1e-5)
    assert res.topk_prompt_logprobs[:cut] == [None] * cut
    for pos in range(cut, len(prompt)):
        row = res.topk_prompt_logprobs[pos]
        assert len(row) == 3 and [lp for _, lp in row] == sorted([lp for _, lp in row])[::-1]
        assert full[pos] <= row[0][1] + 1e-5
        if prompt[pos] in dict(row):
            assert dict(row)[prompt[pos]] == pytest.approx(full[pos], abs=1e-5)
    for seq in res.sequences:
        assert len(seq.tokens) == 5 and len(seq.topk_logprobs) == 5
        for token, lp, row in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
            assert len(row) == 2 and row[0][1] >= row[1][1] and lp <= row[0][1] + 1e-5
            if token in dict(row):
                assert dict(row)[token] == pytest.approx(lp, abs=1e-5)
    with pytest.raises(Exception, match="prompt_logprobs_last_n"):
        sampler.compute_logprobs(
            types.ModelInput.from_ints(prompt), prompt_logprobs_last_n=len(prompt)
        ).result()


def test_a_base_model_named_by_its_hub_id_loads_from_the_offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from gyre.errors import InputError
    from gyre.tinker.config import TinkerServeConfig
    from gyre.tinker.server import build_service
    from helpers import save_qwen2_bpe

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-chat"  # the layout huggingface_hub writes
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    save_qwen2_bpe(repo / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    local = start_in_process(tmp_path / "state", model_path="acme/tiny-chat")
    try:
        sc = tinker.ServiceClient(base_url=local.url, api_key=KEY)
        assert _base(sc) == "acme/tiny-chat"
        tc = sc.create_lora_training_client(base_model="acme/tiny-chat", rank=4).result()
        assert tc.get_info().model_data.tokenizer_id == "acme/tiny-chat"
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4]},
        )
        assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
        sc.close("success").result()
    finally:
        local.stop()
    cfg = TinkerServeConfig(model_path="acme/absent", state_dir=str(tmp_path / "s2"))
    with pytest.raises(InputError, match=r"model_path 'acme/absent'.*HF_HUB_OFFLINE=1"):
        build_service(cfg)


def test_top_k_sampling(client):
    sampler = client.create_sampling_client(base_model=_base(client)).result()
    tok = sampler.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("hello there", add_special_tokens=False))

    def sample(seed: int, **params) -> types.SampleResponse:
        sp = types.SamplingParams(max_tokens=6, seed=seed, stop=[], **params)
        return sampler.sample(prompt, 4, sp, topk_sample_logprobs=3).result()

    greedy = sample(0, temperature=0.0).sequences[0]
    for seq in sample(1, top_k=1).sequences:
        assert seq.tokens == greedy.tokens and seq.logprobs == [0.0] * 6
    res = sample(2, top_k=3, temperature=1.5)
    assert [s.tokens for s in res.sequences] == [
        s.tokens for s in sample(2, top_k=3, temperature=1.5).sequences
    ]
    assert len({tuple(s.tokens) for s in res.sequences}) > 1
    n = prompt.length
    for seq in res.sequences:
        # the untempered model's 3 most likely tokens at each sampled position (temperature
        # keeps the order, so they are the 3 the draw was restricted to)
        scored = sampler.sample(
            types.ModelInput.from_ints([*prompt.to_ints(), *seq.tokens]),
            1,
            types.SamplingParams(max_tokens=1),
            topk_prompt_logprobs=3,
        ).result()
        for t, (token, lp, row) in enumerate(
            zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True)
        ):
            assert token in {i for i, _ in scored.topk_prompt_logprobs[n + t]}
            # the reported logprobs are of the truncated, renormalised distribution
            assert sum(np.exp(v) for _, v in row) == pytest.approx(1.0, abs=1e-5)
            assert dict(row)[token] == pytest.approx(lp, abs=1e-5)
    with pytest.raises(Exception, match=r"sampling_params\.top_k"):
        sample(0, top_k=-2)


def test_target_prompt_logprobs_dense_and_sparse_and_alternative_tokens(client):
    sampler = client.create_sampling_client(base_model=_base(client)).result()
    ids = sampler.get_tokenizer().encode("hello there, tinker", add_special_tokens=False)
    prompt = types.ModelInput.from_ints(ids)
    rows = len(ids) - 1
    own = sampler.compute_logprobs(prompt).result()[1:]  # the untempered model's, row i = i + 1
    want = torch.full((rows, 6), -1, dtype=torch.long)
    want[:, 0] = torch.tensor(ids[1:])  # the prompt's own tokens: their prompt logprobs
    want[3, 4], want[5, 5] = 7, 11

    def ask(targets: types.TensorData, alt_k: int = 0) -> types.SampleResponse:
        sp = types.SamplingParams(max_tokens=1, seed=4)
        return sampler.sample(
            prompt, 1, sp, target_prompt_logprobs=targets, prompt_alt_tokens_k=alt_k
        ).result()

    dense = ask(types.TensorData.from_torch(want)).target_prompt_logprobs
    assert dense.sparse_crow_indices is None and dense.shape == [rows, 6]
    got = dense.to_torch()
    np.testing.assert_allclose(got[:, 0].numpy(), own, atol=1e-5)
    assert (got[want == -1] == 0.0).all()  # a -1 cell gets nothing
    sparse_in = types.TensorData.from_torch_sparse(want[:, 1:], pad_value=-1)
    assert sparse_in.sparse_crow_indices is not None  # only two cells named
    sparse = ask(sparse_in).target_prompt_logprobs
    assert sparse.sparse_col_indices == sparse_in.sparse_col_indices
    assert sparse.to_torch()[3, 3] == pytest.approx(float(got[3, 4]), abs=1e-6)
    assert sparse.to_torch()[5, 4] == pytest.approx(float(got[5, 5]), abs=1e-6)
    assert float(got[3, 4]) < 0 and float(got[5, 5]) < 0

    alt = ask(types.TensorData.from_torch(want), alt_k=5).prompt_alt_tokens
    tokens, lps = alt.tokens.to_torch(), alt.logprobs.to_torch()
    assert tokens.shape == lps.shape == (rows, 5) and tokens.dtype == torch.int64
    again = ask(types.TensorData.from_torch(want), alt_k=5).prompt_alt_tokens  # seeded: same
    assert torch.equal(again.tokens.to_torch(), tokens)
    assert len(set(tokens.flatten().tolist())) > 5  # real draws, not one token repeated
    # each draw's logprob is the model's: score the draws as targets and compare
    scored = ask(alt.tokens).target_prompt_logprobs.to_torch()
    torch.testing.assert_close(scored, lps, atol=1e-5, rtol=0)
    with pytest.raises(Exception, match="target_prompt_logprobs"):
        ask(types.TensorData.from_torch(want[:-1]))  # one row short
    with pytest.raises(Exception, match="target_prompt_logprobs"):
        ask(types.TensorData.from_torch(torch.full((rows, 2), -1, dtype=torch.long)))
