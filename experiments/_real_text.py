"""Real English text for experiments: the licence texts Debian ships.

DESIGN.md asks for real text with no network. Every Debian-based system has
long, stable English prose under ``/usr/share/common-licenses/``: the GPL-3
alone is about 5,600 words. Passages are consecutive, non-overlapping windows
of whole words from these files, drawn without replacement with a seeded
numpy generator, so a seed names the same passages on every such machine;
``return_sources=True`` says which file and word range each came from, so
results can record it.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

LICENSE_DIR = pathlib.Path("/usr/share/common-licenses")
# Long prose, each a distinct text (GPL, LGPL and GFDL are symlinks to some
# of these; LGPL-3 is a short addendum to GPL-3).
REAL_TEXT_FILES = (
  "GPL-3",
  "Apache-2.0",
  "GFDL-1.3",
  "LGPL-2.1",
  "GPL-2",
  "MPL-2.0",
  "Artistic",
)


def _windows(path: pathlib.Path, max_words: int):
  words = path.read_text(encoding="utf-8", errors="replace").split()
  if not words:
    return []
  if len(words) <= max_words:
    return [(" ".join(words), f"{path} words 0-{len(words)}")]
  out = []
  for start in range(0, len(words) - max_words + 1, max_words):
    stop = start + max_words
    out.append((" ".join(words[start:stop]), f"{path} words {start}-{stop}"))
  return out


def real_text_passages(
  num_passages: int,
  max_words: int = 200,
  seed: int = 0,
  *,
  files: tuple[str, ...] = REAL_TEXT_FILES,
  directory: str | os.PathLike | None = None,
  return_sources: bool = False,
):
  """Passages of real English text from the licences Debian ships.

  Args:
    num_passages: how many passages, at least 1.
    max_words: words per passage (whitespace-separated, whitespace collapsed
      to single spaces); a file shorter than this gives one shorter passage.
    seed: seed of the numpy generator that picks the passages.
    files: file names under ``directory``; absent names are skipped.
    directory: where the files are; default ``/usr/share/common-licenses``.
    return_sources: also return, per passage, ``"<path> words <a>-<b>"``.

  Returns:
    A list of ``num_passages`` distinct strings, or ``(passages, sources)``
    when ``return_sources``.

  Raises:
    ValueError: if ``num_passages`` or ``max_words`` is not a positive int, or
      more passages are asked for than the files hold.
    FileNotFoundError: if none of ``files`` exists under ``directory``.

  Example:
    >>> texts = real_text_passages(3, max_words=50)  # doctest: +SKIP
  """
  if not isinstance(num_passages, int) or num_passages < 1:
    raise ValueError(f"{num_passages=} must be a positive int")
  if not isinstance(max_words, int) or max_words < 1:
    raise ValueError(f"{max_words=} must be a positive int")
  root = LICENSE_DIR if directory is None else pathlib.Path(directory)
  found = []
  for name in files:
    path = (root / name).resolve()
    if path.is_file() and path not in found:
      found.append(path)
  if not found:
    raise FileNotFoundError(
      f"none of {files=} found under {root}; real_text_passages needs the "
      "licence texts of a Debian-based system (package base-files), or pass "
      "directory= and files= naming long plain-text files"
    )
  pool = [w for path in found for w in _windows(path, max_words)]
  if num_passages > len(pool):
    raise ValueError(
      f"{num_passages=} exceeds the {len(pool)} passages of {max_words=} "
      f"words in {[p.name for p in found]}"
    )
  rng = np.random.default_rng(seed)
  picks = rng.choice(len(pool), size=num_passages, replace=False)
  texts = [pool[i][0] for i in picks]
  if return_sources:
    return texts, [pool[i][1] for i in picks]
  return texts
