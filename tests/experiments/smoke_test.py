"""Every experiment binary runs with its smoke config (experiments/README.md).

Each binary named by a config in experiments/configs/ is run in-process
through its flag-free ``run(config, workdir)`` with ``get_config('smoke')``,
except those whose smoke run (with checks of their own numbers) lives in
another test (``ELSEWHERE``); a test here fails if a config has no binary
or no smoke test. Every run must leave the convention's outputs: config.json
equal to the config, metrics.jsonl, a PNG figure, and for benchmarks
results.json with the machine and load; a second run into the same workdir
must refuse.
"""

import importlib
import json
import pathlib
import tempfile

import pytest
from absl.testing import absltest
from absl.testing import parameterized

from experiments import _common

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(
  p.stem
  for p in (REPO / "experiments" / "configs").glob("*.py")
  if not p.stem.startswith("_")
)

# Binaries whose smoke config runs in another test, with their own checks.
ELSEWHERE = {
  "k_eps_scaling": "tests/experiments/binaries_test.py",
  "bound_tightness": "tests/experiments/binaries_test.py",
  "output_error": "tests/experiments/binaries_test.py",
  "nc_sparsity": "tests/experiments/binaries_test.py",
  "certified_search": "tests/experiments/binaries_test.py",
  "native_topk": "tests/experiments/native_topk_test.py",
  "bench_scaling": "tests/parallel/bench_scaling_test.py",  # subprocess
  "kv_retrieval": "tests/experiments/kv_retrieval_test.py",
  "train_long_context": "tests/experiments/long_context_test.py",
  "long_context": "tests/experiments/long_context_test.py",
}
HERE = tuple(name for name in CONFIGS if name not in ELSEWHERE)


def _smoke(name):
  module = importlib.import_module(f"experiments.{name}")
  config = importlib.import_module(f"experiments.configs.{name}")
  return module, config.get_config("smoke")


class CoverageTest(absltest.TestCase):
  def test_every_config_has_a_binary_and_a_smoke_test(self):
    for name in CONFIGS:
      self.assertTrue((REPO / "experiments" / f"{name}.py").is_file(), name)
      if name in ELSEWHERE:
        text = (REPO / ELSEWHERE[name]).read_text()
        self.assertIn(name, text, f"{ELSEWHERE[name]} does not run {name}")
    for name in ELSEWHERE:
      self.assertIn(name, CONFIGS)

  def test_every_binary_uses_the_common_entry_point(self):
    for name in CONFIGS:
      text = (REPO / "experiments" / f"{name}.py").read_text()
      self.assertIn("_common.", text, name)
      own_main = name in ("native_topk", "bench_scaling")  # extra flags
      self.assertIn("app.run(main)" if own_main else "_common.app_main(", text)


@pytest.mark.slow
class SmokeRunTest(parameterized.TestCase):
  @parameterized.named_parameters((name, name) for name in HERE)
  def test_smoke_run(self, name):
    module, config = _smoke(name)
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    workdir = pathlib.Path(tmp.name) / "run"
    result = module.run(config, workdir)
    saved = json.loads((workdir / "config.json").read_text())
    self.assertEqual(saved, _common._to_jsonable(config.to_dict()))
    self.assertNotEmpty(_common.read_metrics(workdir))
    self.assertNotEmpty(list(workdir.glob("*.png")))
    if name.startswith("bench_"):
      meta = json.loads((workdir / "results.json").read_text())["meta"]
      for field in ("machine", "jax", "backend", "load_average_1_5_15"):
        self.assertIn(field, meta)
    with self.assertRaisesRegex(_common.WorkdirNotEmptyError, "--overwrite"):
      module.run(config, workdir)
    getattr(self, f"_check_{name}")(result)

  def _check_bench_append(self, record):
    self.assertLen(record["results"], 3)  # kv, index, paged; one size
    for r in record["results"]:
      self.assertTrue(r["same_result"])  # donated == copying, every field
      self.assertEqual(r["length_after"], r["fill"] + 2 + 2)
      # The donated append updates every byte of the cache in place.
      self.assertEqual(r["alias_bytes_append"], r["cache_bytes_append"])
      self.assertEqual(r["alias_bytes_copy"], 0)

  def _check_bench_decode(self, record):
    (r,) = record["results"]
    self.assertLess(r["max_abs_diff_vs_lax_topk"], 1e-5)
    for variant in ("floor", "dense", "lax_topk", "jaxtopk"):
      self.assertGreater(r[variant]["min_ms"], 0.0)
    self.assertGreater(r["jaxtopk_dense_q4_over_q1_min"], 0.0)
    self.assertTrue(r["cert_peaked_q4_valid"])
    self.assertLessEqual(r["cert_peaked_q4_tv_bound_max"], 0.05)

  def _check_bench_serving(self, record):
    (r,) = record["results"]
    self.assertTrue(r["paged_equals_flat"])  # same outputs, same bounds
    self.assertTrue(r["cert_valid"])
    self.assertLessEqual(r["cert_tv_bound_max"], 0.05)
    self.assertEqual(r["num_pages"], 6 + 13 + 4)  # pages of 16 held
    for variant in ("floor", "gather", "dense_paged", "cert_paged"):
      self.assertGreater(r[variant]["min_ms"], 0.0)
    (c,) = record["chunk"]
    self.assertLess(c["dense_max_abs_diff_vs_jax_nn"], 1e-5)
    for name in ("cert", "cert_exact"):
      self.assertTrue(c[f"{name}_valid"])
      self.assertLessEqual(c[f"{name}_tv_bound_max"], 0.05)
      self.assertGreater(c[f"{name}_over_dense_min"], 0.0)
    g = record["generate"]
    for name in ("dense", "certified"):
      self.assertEqual(g[name]["new_tokens"], 3 * 3)  # every request
      self.assertTrue(g[name]["all_valid"])
    self.assertEqual(g["dense"]["tv_bound_max"], 0.0)
    self.assertLessEqual(g["certified"]["tv_bound_max"], 0.05)

  def _check_bench_selection(self, record):
    (r,) = record["exact"]
    self.assertEqual(r["same_keep_fraction"], 1.0)
    self.assertLessEqual(r["tv_bound_max"], 0.05)
    for rows in record["delta"]["synthetic"].values():
      for row in rows:
        self.assertTrue(row["all_sound"])
        self.assertGreaterEqual(row["keys_scored_fraction"], row["oracle"])

  def _check_bench_minilm(self, record):
    for name in ("load_minilm", "embed_forward_jit", "minilm_attention_rows"):
      self.assertLessEqual(record[name]["min_s"], record[name]["median_s"])
    self.assertLen(record["text_sources"], 2)

  def _check_bench_flax_layers(self, record):
    cert = record["decode"]["topk_fixed_k_2"]["certificate"]
    self.assertEqual(cert["k_kept_mean"], 2.0)
    self.assertEqual(
      record["decode"]["nnx_multi_head_attention"]["cache_filled_to"], 31
    )

  def _check_bound_study(self, record):
    r = record["llm_like"]
    self.assertEqual(r["heads"], 5)
    for fam in ("codes8", "ball16", "pca8", "lib_auto", "lib_exact"):
      self.assertGreater(r[fam], 0.0)
    self.assertLessEqual(r["lib_auto_max"], 1.25 + 0.05)
    self.assertEqual(r["lib_exact"], 1.0)  # the exact search scores all
    for p in ("auto", "codes", "exact"):
      self.assertEqual(r[f"lib_{p}_sound"], 1.0)
      self.assertLessEqual(r[f"lib_{p}_tv_max_max"], 0.05)

  def _check_bench_attention(self, record):
    for r in record["prefill"]:
      dense = r["variants"]["dense"]
      self.assertLess(dense["max_abs_diff_vs_jax_nn"], 1e-4)
      for var in ("certified", "certified_exact", "certified_delta"):
        cert = r["variants"][var]["certificate"]
        self.assertLessEqual(cert["tv_bound_max"], 0.05)
        self.assertEqual(cert["valid_fraction"], 1.0)
    (mem,) = record["memory"]
    self.assertGreater(mem["peak_rss_gib"], 0.0)
    for phase in ("forward", "train_step"):
      for row in record["flax"][phase].values():
        self.assertGreater(row["first_call_s"], 0.0)

  def _check_bench_kernels(self, record):
    self.assertIsNone(record["timings"])
    self.assertIn("interpret mode", record["note"])
    smoke = record["smoke"]
    self.assertLess(smoke["decode_max_abs_diff_vs_reference"], 1e-4)
    self.assertEqual(smoke["decode_certificate"]["valid_fraction"], 1)


class BenchFlaxLayersArgsTest(absltest.TestCase):
  def test_unknown_layer_name_raises(self):
    from experiments import bench_flax_layers

    with self.assertRaisesRegex(ValueError, "name='nope'"):
      bench_flax_layers.measure(1, 8, 1, 2, 1, only=["nope"])


if __name__ == "__main__":
  absltest.main()
