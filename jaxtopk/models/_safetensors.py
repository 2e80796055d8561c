"""Reading and writing the safetensors format with numpy alone.

The format (https://github.com/huggingface/safetensors): an 8-byte
little-endian header length N, N bytes of JSON mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the byte
buffer that follows the header; an optional ``"__metadata__"`` entry), then
the buffer. Reading memory-maps the file, so a tensor costs nothing until it
is converted; bfloat16 and float8 tensors read through ``ml_dtypes`` (a jax
dependency), which the ``safetensors`` package's numpy API does not do.
"""

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """The tensors of one safetensors file, as read-only memory-mapped arrays.

  Args:
    path: a ``.safetensors`` file.

  Returns:
    ``{name: array}`` in the file's dtypes and shapes.

  Raises:
    ValueError: a malformed header or an unknown dtype (named).
  """
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8:
      raise ValueError(f"{path}: header length {n} exceeds the file")
    header = json.loads(f.read(n))
  buf: np.ndarray
  if size > 8 + n:
    buf = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
  else:  # no tensor bytes (mmap refuses an empty range)
    buf = np.zeros(0, np.uint8)
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']!r}")
    dtype = _DTYPES[info["dtype"]]
    begin, end = info["data_offsets"]
    shape = tuple(info["shape"])
    if end - begin != int(np.prod(shape)) * dtype.itemsize:
      raise ValueError(f"{path}: tensor {name!r} has inconsistent offsets")
    out[name] = buf[begin:end].view(dtype).reshape(shape)
  return out


def write_safetensors(
  path: str | os.PathLike,
  tensors: dict[str, np.ndarray],
  metadata: dict[str, str] | None = None,
) -> None:
  """Writes ``tensors`` to one safetensors file (names sorted).

  Args:
    path: the file to write (replaced atomically).
    tensors: ``{name: array}``; dtypes among those the format names.
    metadata: optional string-to-string ``__metadata__``.

  Raises:
    ValueError: an unsupported dtype (named).
  """
  header: dict = {}
  if metadata:
    header["__metadata__"] = dict(metadata)
  arrays, offset = [], 0
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _NAMES:
      raise ValueError(f"tensor {name!r} has unsupported dtype {a.dtype}")
    header[name] = dict(
      dtype=_NAMES[a.dtype],
      shape=list(a.shape),
      data_offsets=[offset, offset + a.nbytes],
    )
    arrays.append(a)
    offset += a.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # align the buffer to 8 bytes
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for a in arrays:
      f.write(a.tobytes())
  os.replace(tmp, path)
