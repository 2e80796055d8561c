"""Real English text for experiments: a public-domain book jaxtopk ships.

DESIGN.md asks for real text with no network. The package ships Ambrose
Bierce's "The Devil's Dictionary" (1911, public domain, about 61,000 words;
``jaxtopk.models.public_domain_text``, source recorded in
``jaxtopk/models/data/SOURCE.txt``), so every machine and operating system
has the same text. Passages are consecutive, non-overlapping windows of
whole words, drawn without replacement with a seeded numpy generator, so a
seed names the same passages everywhere; ``return_sources=True`` says which
text and word range each came from, so results can record it. Other plain
text files can be used instead (``directory=`` and ``files=``).
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from jaxtopk import models

# The name the shipped text goes by in ``return_sources``.
SHIPPED_TEXT = "jaxtopk.models.public_domain_text"


def _windows(words: list[str], max_words: int, name: str):
  if not words:
    return []
  if len(words) <= max_words:
    return [(" ".join(words), f"{name} words 0-{len(words)}")]
  out = []
  for start in range(0, len(words) - max_words + 1, max_words):
    stop = start + max_words
    out.append((" ".join(words[start:stop]), f"{name} words {start}-{stop}"))
  return out


def _documents(files, directory):
  """``[(name, words)]``: the shipped text, or the named files."""
  if directory is None:
    if files is not None:
      raise ValueError(f"{files=} needs directory= (where the files are)")
    return [(SHIPPED_TEXT, models.public_domain_text().split())]
  root = pathlib.Path(directory)
  found = []
  for name in files or ():
    path = (root / name).resolve()
    if path.is_file() and path not in found:
      found.append(path)
  if not found:
    raise FileNotFoundError(
      f"none of {files=} found under {root}; pass directory= and files="
      " naming long plain-text files, or neither for the shipped text"
    )
  return [
    (str(p), p.read_text(encoding="utf-8", errors="replace").split())
    for p in found
  ]


def real_text_passages(
  num_passages: int,
  max_words: int = 200,
  seed: int = 0,
  *,
  files: tuple[str, ...] | None = None,
  directory: str | os.PathLike | None = None,
  return_sources: bool = False,
):
  """Passages of real English text (by default the shipped public-domain book).

  Args:
    num_passages: how many passages, at least 1.
    max_words: words per passage (whitespace-separated, whitespace collapsed
      to single spaces); a text shorter than this gives one shorter passage.
    seed: seed of the numpy generator that picks the passages.
    files: file names under ``directory`` (absent names are skipped); only
      with ``directory``.
    directory: where ``files`` are; None (default): the text jaxtopk ships,
      ``jaxtopk.models.public_domain_text()`` (no system path is read).
    return_sources: also return, per passage, ``"<text> words <a>-<b>"``.

  Returns:
    A list of ``num_passages`` distinct strings, or ``(passages, sources)``
    when ``return_sources``.

  Raises:
    ValueError: if ``num_passages`` or ``max_words`` is not a positive int, or
      more passages are asked for than the texts hold.
    FileNotFoundError: if ``directory`` holds none of ``files``.

  Example:
    >>> texts = real_text_passages(3, max_words=50)
    >>> len(texts), len(texts[0].split())
    (3, 50)
  """
  if not isinstance(num_passages, int) or num_passages < 1:
    raise ValueError(f"{num_passages=} must be a positive int")
  if not isinstance(max_words, int) or max_words < 1:
    raise ValueError(f"{max_words=} must be a positive int")
  docs = _documents(files, directory)
  pool = [w for name, words in docs for w in _windows(words, max_words, name)]
  if num_passages > len(pool):
    raise ValueError(
      f"{num_passages=} exceeds the {len(pool)} passages of {max_words=} "
      f"words in {[name for name, _ in docs]}"
    )
  rng = np.random.default_rng(seed)
  picks = rng.choice(len(pool), size=num_passages, replace=False)
  texts = [pool[i][0] for i in picks]
  if return_sources:
    return texts, [pool[i][1] for i in picks]
  return texts
