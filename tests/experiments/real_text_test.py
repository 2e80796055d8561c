"""Tests for real_text_passages (a shipped public-domain book as real text)."""

import pathlib
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from experiments import _real_text
from experiments.configs import k_eps_scaling
from jaxtopk import models

REPO = pathlib.Path(__file__).resolve().parents[2]

# Paths opened while ``_OPENED`` is a list (an audit hook cannot be removed:
# it records only inside ``_opened_paths``).
_OPENED: list[str] | None = None


def _audit(event, args):
  if _OPENED is not None and event == "open" and args and args[0] is not None:
    _OPENED.append(str(args[0]))


sys.addaudithook(_audit)


def _opened_paths(fn):
  """``fn()`` and every path it opened."""
  global _OPENED
  _OPENED = []
  try:
    return fn(), list(_OPENED)
  finally:
    _OPENED = None


class RealTextPassagesTest(parameterized.TestCase):
  def setUp(self):
    super().setUp()
    # A private directory with known files, so the mechanics are tested on
    # any machine; the shipped text is tested separately below.
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = pathlib.Path(tmp.name)
    (self.dir / "A").write_text(" ".join(f"a{i}" for i in range(13)))
    (self.dir / "B").write_text("b0  b1\n\n b2\tb3 b4 b5 b6")
    (self.dir / "C").write_text("c0 c1")  # shorter than a window

  def _passages(self, n, max_words=5, seed=0, **kw):
    return _real_text.real_text_passages(
      n, max_words, seed, files=("A", "B", "C", "Z"), directory=self.dir, **kw
    )

  def test_windows_are_consecutive_words_with_sources(self):
    texts, sources = self._passages(4, return_sources=True)
    expect = {
      f"{self.dir / 'A'} words 0-5": "a0 a1 a2 a3 a4",
      f"{self.dir / 'A'} words 5-10": "a5 a6 a7 a8 a9",
      f"{self.dir / 'B'} words 0-5": "b0 b1 b2 b3 b4",
      f"{self.dir / 'C'} words 0-2": "c0 c1",
    }
    self.assertCountEqual(sources, expect)
    for text, source in zip(texts, sources, strict=True):
      self.assertEqual(text, expect[source])

  def test_seeded_and_distinct(self):
    self.assertEqual(self._passages(3, seed=7), self._passages(3, seed=7))
    orders = {tuple(self._passages(4, seed=s)) for s in range(11)}
    self.assertGreater(len(orders), 1)  # the seed matters
    self.assertLen(set(self._passages(4)), 4)

  @parameterized.named_parameters(
    ("zero_passages", dict(n=0), ValueError, "num_passages=0"),
    ("too_many", dict(n=5), ValueError, "num_passages=5 exceeds the 4"),
    ("zero_words", dict(n=1, max_words=0), ValueError, "max_words=0"),
  )
  def test_bad_input_raises(self, kwargs, error, message):
    with self.assertRaisesRegex(error, message):
      self._passages(**kwargs)

  def test_missing_files_raise(self):
    with tempfile.TemporaryDirectory() as empty:
      with self.assertRaisesRegex(FileNotFoundError, "shipped text"):
        _real_text.real_text_passages(1, files=("A",), directory=empty)
    with self.assertRaisesRegex(ValueError, "needs directory="):
      _real_text.real_text_passages(1, files=("A",))

  def test_shipped_text(self):
    texts, sources = _real_text.real_text_passages(
      13, 200, 0, return_sources=True
    )
    self.assertLen(texts, 13)
    for text, source in zip(texts, sources, strict=True):
      self.assertLen(text.split(), 200)
      self.assertTrue(source.startswith(_real_text.SHIPPED_TEXT + " words "))
    # English prose: the commonest words are there.
    words = " ".join(texts).lower().split()
    for common in ("the", "of", "to"):
      self.assertIn(common, words)
    # Enough for the largest config (64 passages of 200 words).
    self.assertGreater(len(models.public_domain_text().split()), 60_000)

  def test_main_job_text_reads_no_system_path(self):
    # The main job's passages (experiments.k_eps_scaling, default config)
    # come from the package's own data: no /usr/share file is opened.
    models.public_domain_text.cache_clear()
    m = k_eps_scaling.get_config().minilm
    texts, opened = _opened_paths(
      lambda: _real_text.real_text_passages(m.num_passages, m.max_len)
    )
    self.assertLen(texts, m.num_passages)
    self.assertTrue(
      any(p.endswith("the_devils_dictionary.txt") for p in opened)
    )
    self.assertEqual([p for p in opened if p.startswith("/usr/share")], [])

  def test_no_system_data_path_in_sources(self):
    # Neither the library, the experiments nor the notebooks name a
    # system data directory (which exists on some systems only): every
    # text they read ships with the package.
    roots = ("jaxtopk", "experiments", "colab")
    hits = [
      str(p.relative_to(REPO))
      for root in roots
      for p in sorted((REPO / root).rglob("*"))
      if p.suffix in (".py", ".ipynb")
      and "/usr/share" in p.read_text(errors="replace")
    ]
    self.assertEqual(hits, [])


if __name__ == "__main__":
  absltest.main()
