"""The SDK's binary wire format: ``forward_backward`` bodies in, ``ForwardBackwardOutput`` and
``SampleResponse`` payloads out.

The Tinker SDK sends ``/api/v1/forward_backward`` as a protobuf message (optionally zstd
compressed) and asks for ``retrieve_future`` results of those two types as protobuf too
(``Accept: application/x-protobuf``). The schema is the SDK's own generated module
``tinker.proto.tinker_public_pb2``; this file only converts between those messages and plain
numpy arrays, so the rest of the server never sees protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.tinker.errors import UserError

PROTO_CONTENT_TYPE = "application/x-protobuf"


def _pb():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("gyre tinker-serve needs its extra: pip install 'gyre[tinker]'") from exc
    return tinker_public_pb2


@dataclass
class WireDatum:
    """One training sequence: the input token ids and its named loss inputs (dense arrays)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class FwdBwdCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum]


def _dtype(code: int, field: str) -> np.dtype:
    pb = _pb()
    table = {
        pb.DTYPE_FLOAT32: np.dtype(np.float32),
        pb.DTYPE_INT64: np.dtype(np.int64),
        pb.DTYPE_INT32: np.dtype(np.int32),
    }
    if code not in table:
        raise UserError(f"{field}: unsupported tensor dtype {code}")
    return table[code]


def tensor_to_numpy(msg, field: str) -> np.ndarray:
    """A proto ``Tensor`` (dense, or sparse CSR for 2-D) as a dense array of its shape."""
    dt = _dtype(msg.dtype, field)
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dt)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise UserError(f"{field}: malformed sparse tensor (shape {shape})")
        out = np.zeros(shape, dtype=dt)
        for r in range(shape[0]):
            lo, hi = int(crow[r]), int(crow[r + 1])
            out[r, col[lo:hi]] = values[lo:hi]
        return out
    flat = np.frombuffer(msg.dense, dtype=dt)
    if shape and int(np.prod(shape)) != flat.size:
        raise UserError(f"{field}: {flat.size} values do not fill shape {shape}")
    return flat.reshape(shape) if shape else flat


def decode_forward_backward(body: bytes, content_encoding: str = "") -> FwdBwdCall:
    """Parse the SDK's ``ForwardBackwardRequest`` protobuf body."""
    if content_encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body)
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:
        raise UserError(f"body: not a ForwardBackwardRequest protobuf ({exc})") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # v2 wins: it also carries strings
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise UserError(
                    f"data[{i}].model_input: {kind} chunks are not supported (text tokens only)"
                )
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {
            name: tensor_to_numpy(t, f"data[{i}].loss_fn_inputs.{name}")
            for name, t in d.loss_fn_inputs.items()
        }
        data.append(WireDatum(tokens, inputs))
    return FwdBwdCall(msg.model_id, msg.seq_id, msg.loss_fn, config, bool(msg.forward_only), data)


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """``ForwardBackwardOutput``: one ArrayRecord whose fields batch every datum's 1-D arrays."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in outputs[0] if outputs else []:
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
        bt = record.fields[name]
        bt.dtype = pb.DTYPE_FLOAT32
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
        bt.trailing_shape.extend(list(arrays[0].shape[1:]) if arrays else [])
    return msg.SerializeToString()


MASK_LOGPROB = -99999.0  # the SDK's filler for a top-k row with nothing in it

TopK = tuple[np.ndarray, np.ndarray]  # (N, k) int32 token ids, (N, k) float32 logprobs


@dataclass
class SampledSeq:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # True: a stop token/string ended it; False: max_tokens
    topk: TopK | None = None  # topk_sample_logprobs, one row per token


@dataclass
class TensorOut:
    """A 2-D answer tensor: ``values`` flat, dense in ``shape`` or at the CSR cells."""

    values: np.ndarray
    shape: tuple[int, int]
    csr: tuple[list[int], list[int]] | None = None  # (crow_indices, col_indices)


def _put_tensor(msg, t: TensorOut) -> None:
    pb = _pb()
    v = np.ascontiguousarray(t.values)
    msg.dtype = pb.DTYPE_INT64 if v.dtype.kind in "iu" else pb.DTYPE_FLOAT32
    v = v.astype(np.int64 if v.dtype.kind in "iu" else np.float32)
    msg.shape.extend(t.shape)
    if t.csr is None:
        msg.dense = v.tobytes()
    else:
        msg.sparse_csr.values = v.tobytes()
        msg.sparse_csr.crow_indices = np.asarray(t.csr[0], dtype=np.int64).tobytes()
        msg.sparse_csr.col_indices = np.asarray(t.csr[1], dtype=np.int64).tobytes()


def _put_topk(msg, topk: TopK) -> None:
    ids, lps = topk
    msg.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(lps, dtype=np.float32).tobytes()
    msg.length, msg.k = int(ids.shape[0]), int(ids.shape[1])


def encode_sample_response(
    seqs: list[SampledSeq],
    prompt_logprobs: np.ndarray | None,
    prompt_topk: TopK | None = None,
    targets: TensorOut | None = None,
    alt: tuple[np.ndarray, np.ndarray] | None = None,
) -> bytes:
    """``SampleResponse``; ``prompt_logprobs`` (len(prompt),) with NaN where none (position 0);
    ``targets``: ``target_prompt_logprobs``; ``alt``: ``prompt_alt_tokens`` (ids, logprobs)."""
    pb = _pb()
    msg = pb.SampleResponse()
    for s in seqs:
        out = msg.sequences.add()
        out.stop_reason = pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH
        out.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        out.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
        if s.topk is not None:
            _put_topk(out.topk_sampled_logprobs, s.topk)
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if prompt_topk is not None:
        _put_topk(msg.topk_prompt_logprobs, prompt_topk)
    if targets is not None:
        _put_tensor(msg.target_prompt_logprobs, targets)
    if alt is not None:
        ids, lps = alt
        shape = (int(ids.shape[0]), int(ids.shape[1]))
        _put_tensor(msg.prompt_alt_tokens.tokens, TensorOut(ids.ravel(), shape))
        _put_tensor(msg.prompt_alt_tokens.logprobs, TensorOut(lps.ravel(), shape))
    return msg.SerializeToString()
