"""The kv_retrieval experiment's smoke config runs and writes its outputs."""

import tempfile

import pytest
from absl.testing import absltest

from experiments import _common
from experiments import kv_retrieval
from experiments.configs import kv_retrieval as config_lib


class KvRetrievalSmokeTest(absltest.TestCase):
  @pytest.mark.slow
  def test_smoke_run(self):
    config = config_lib.get_config("smoke")
    with tempfile.TemporaryDirectory() as tmp:
      out = kv_retrieval.run(config, tmp)
      self.assertGreater(out["searches"], 0)
      kinds = {r["kind"] for r in _common.read_metrics(tmp)}
      for kind in ("cache", "search", "window", "update", "timing", "decoder"):
        self.assertIn(kind, kinds)
      caches = {r["cache"] for r in _common.read_metrics(tmp, "cache")}
      self.assertEqual(
        caches, {"minilm", "decoder", "clustered", "local_window"}
      )
      for r in _common.read_metrics(tmp, "search"):
        if "sound_rows" in r:  # every certificate is checked vs float64
          self.assertEqual(r["sound_rows"], r["rows"], r)
        self.assertLessEqual(r["tv_bound_max"], r["eps"] * (1 + 1e-6), r)
      for r in _common.read_metrics(tmp, "window"):
        self.assertEqual(r["sound_rows"], r["rows"], r)
      for name in ("kv_scored", "kv_windows", "kv_timing"):
        with open(f"{tmp}/{name}.png", "rb") as f:
          self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
      with self.assertRaises(_common.WorkdirNotEmptyError):
        kv_retrieval.run(config, tmp)


if __name__ == "__main__":
  absltest.main()
