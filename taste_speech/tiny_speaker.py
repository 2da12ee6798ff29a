"""A tiny stand-in for the published speaker encoder (``cosyvoice/speaker_embed.onnx``, CAMPPlus).

Tiny checkpoints ship one so that they exercise the published path: reference audio -> Kaldi fbank
-> ONNX model -> speaker vector, run by onnxruntime exactly as the real 192-d CAMPPlus is. The graph
is ``feats (1, T, 80) -> MatMul W (80, D) -> Tanh -> ReduceMean over T -> (1, D)``. It is written
as ONNX protobuf directly (a few dozen bytes of structure around ``W``), so building a tiny
checkpoint needs neither the ``onnx`` package nor ``torch.onnx``.
"""

from __future__ import annotations

import numpy as np

FBANK_BINS = 80  # CAMPPlus input: 80-bin Kaldi fbank
INPUT_NAME = "feats"  # the published model's input name


# -- protobuf wire format (only what an ONNX ModelProto with one small graph needs) ---------------
def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _bytes(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _str(field: int, text: str) -> bytes:
    return _bytes(field, text.encode())


def _value_info(name: str, dims: list) -> bytes:
    """ValueInfoProto of a float tensor; a str dim is symbolic (dynamic)."""
    shape = b"".join(_bytes(1, _str(2, d) if isinstance(d, str) else _int(1, d)) for d in dims)
    tensor_type = _int(1, 1) + _bytes(2, shape)  # elem_type FLOAT
    return _str(1, name) + _bytes(2, _bytes(1, tensor_type))


def _node(op: str, inputs: list[str], outputs: list[str], attributes: bytes = b"") -> bytes:
    return b"".join(_str(1, i) for i in inputs) + b"".join(_str(2, o) for o in outputs) + _str(4, op) + attributes


def write_speaker_model(path, weight: np.ndarray, input_name: str = INPUT_NAME) -> None:
    """Write the stand-in encoder with projection ``weight`` (80, D) to ``path``."""
    weight = np.ascontiguousarray(weight, dtype="<f4")
    if weight.ndim != 2 or weight.shape[0] != FBANK_BINS:
        raise ValueError(f"the projection must be ({FBANK_BINS}, D), got {weight.shape}")
    initializer = (_int(1, weight.shape[0]) + _int(1, weight.shape[1]) + _int(2, 1)  # dims, FLOAT
                   + _str(8, "W") + _bytes(9, weight.tobytes()))
    axes = _bytes(5, _str(1, "axes") + _int(8, 1) + _int(20, 7))  # attribute INTS [1]
    keepdims = _bytes(5, _str(1, "keepdims") + _int(3, 0) + _int(20, 2))  # attribute INT 0
    graph = (
        _bytes(1, _node("MatMul", [input_name, "W"], ["projected"]))
        + _bytes(1, _node("Tanh", ["projected"], ["activated"]))
        + _bytes(1, _node("ReduceMean", ["activated"], ["embedding"], axes + keepdims))
        + _str(2, "tiny_campplus")
        + _bytes(5, initializer)
        + _bytes(11, _value_info(input_name, [1, "T", FBANK_BINS]))
        + _bytes(12, _value_info("embedding", [1, weight.shape[1]]))
    )
    # ir_version 7, opset 13 (ReduceMean still takes axes as an attribute there)
    model = _int(1, 7) + _str(2, "pipecat-taste") + _bytes(7, graph) + _bytes(8, _str(1, "") + _int(2, 13))
    with open(path, "wb") as f:
        f.write(model)
