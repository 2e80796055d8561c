"""Model weights shipped with the package.

``weights/long_context_lm``: the small long-context model of the Llama 3
family that experiments/train_long_context.py trains on a CPU (real text and
RULER-style retrieval, contexts grown to 4,096 tokens), as a Hugging Face
directory (config.json, model.safetensors, tokenizer.json) that
``jaxtopk.models.load_pretrained`` reads.
"""

import pathlib

WEIGHTS_DIR = pathlib.Path(__file__).resolve().parent / "weights"
_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def long_context_lm_dir() -> pathlib.Path:
  """Directory of the packaged long-context model.

  Raises:
    FileNotFoundError: the files are missing (rebuild them with
      ``python -m experiments.train_long_context`` and
      ``--config.export_dir``, see experiments/configs/train_long_context.py).
  """
  path = WEIGHTS_DIR / "long_context_lm"
  missing = [name for name in _FILES if not (path / name).is_file()]
  if missing:
    raise FileNotFoundError(
      f"{missing=} in {path}; rebuild with `python -m"
      " experiments.train_long_context --config.export_dir=...` (see"
      " experiments/configs/train_long_context.py)"
    )
  return path
