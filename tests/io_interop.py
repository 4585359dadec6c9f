#!/usr/bin/env python3
"""Reads the .npy and safetensors files pdo wrote into DIR (tests/test_io.cpp) and checks
their values against DIR/expected.txt; then writes files of its own for pdo to read.
safetensors is read and written here from its specification (8-byte little-endian header
length, JSON header, raw little-endian data), with NumPy for the data."""
import json
import struct
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    kinds = {"F64": "<f8", "F32": "<f4", "I64": "<i8", "I32": "<i4", "U8": "|u1"}
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype=kinds[e["dtype"]]).reshape(e["shape"])
    return out


def write_safetensors(path, tensors):
    names = {np.dtype("<f8"): "F64", np.dtype("<f4"): "F32", np.dtype("<i8"): "I64", np.dtype("<i4"): "I32"}
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        b = np.ascontiguousarray(t).tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main():
    d = sys.argv[1]
    with open(f"{d}/expected.txt") as f:
        rows = [line.split() for line in f]
    a = np.array([float(v) for v in rows[0]], dtype=np.float32).reshape(3, 5)
    b = np.array([int(v) for v in rows[1]], dtype=np.int32)
    c = np.array([float(v) for v in rows[2]], dtype=np.float64).reshape(2, 1, 4)

    npy = np.load(f"{d}/pdo_a.npy")
    assert npy.dtype == np.float32 and npy.shape == (3, 5) and np.array_equal(npy, a), "pdo_a.npy differs"
    st = read_safetensors(f"{d}/pdo.safetensors")
    assert np.array_equal(st["a"], a) and st["a"].dtype == np.float32, "pdo.safetensors: a differs"
    assert np.array_equal(st["b"], b) and st["b"].dtype == np.int32, "pdo.safetensors: b differs"
    assert np.array_equal(st["c"], c) and st["c"].dtype == np.float64, "pdo.safetensors: c differs"
    try:  # PyTorch, where installed, reads the same values
        import torch
        assert torch.equal(torch.from_numpy(npy.copy()), torch.from_numpy(a)), "torch: pdo_a.npy differs"
    except ImportError:
        pass

    np.save(f"{d}/py_x.npy", np.arange(6, dtype=np.float64).reshape(2, 3) * 0.25 - 1)
    write_safetensors(f"{d}/py.safetensors", {
        "y": (np.arange(12, dtype=np.float32) / np.float32(8)).reshape(3, 4),
        "z": np.arange(4, dtype=np.int64) * 1000000007,
        "a_from_pdo": st["a"],
    })
    print("io_interop: pdo's files read by NumPy with the same values; NumPy's files written")


if __name__ == "__main__":
    main()
