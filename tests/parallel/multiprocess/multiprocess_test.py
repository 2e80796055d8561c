"""Real multi-process runs: 2 x 4 and 4 x 2 CPU devices as one 8-device mesh.

``worker.py`` runs as several processes on 127.0.0.1
(``jaxtopk.parallel.launch.LocalCluster``: gloo CPU collectives, a free
coordinator port, a deadline, process groups), each calling the library's
multi-host start-up and loading only its own block of every array. Four
runs, one after the other (gloo processes are CPU hungry; the machine has 2
cores):

- R0, the reference: ONE process with 8 devices, as a one-process
  jax.distributed run, so its collectives are gloo's too. Prefill, decode,
  and the native Top-k training (1 dense base step, then
  ``worker.TRAIN_STEPS`` Top-k steps), uninterrupted.
- A, 2 processes x 4 devices: prefill, decode, then the same training in a
  shared workdir, SIGKILLed (process 0, the coordinator and orbax's primary
  host) as soon as a Top-k checkpoint has been finalised.
- B, 4 processes x 2 devices: decode (the KV cache's positions now split
  over 4 processes), then the training resumed from A's checkpoint
  (2 -> 4 processes) and stopped (checkpointed) after step 3.
- C, 1 process x 8 devices WITHOUT jax.distributed (XLA's in-process
  collectives): decode, and the training resumed from B's checkpoint
  (4 -> 1) to the end.

What must hold: every process of a run returns the same global results;
A's and B's results are bitwise those of R0 (same collectives, same
reduction order); C's equal R0's kept sets and counts exactly and its
floats within the float32 tolerance (the in-process all-reduce sums in
another order: measured differences are a few ulps); every tv_bound and
output-error bound is sound against float64 truth; the loss curve stitched
from A, B and C is R0's: bitwise up to step 3 (gloo), within tolerance at
the last step (C).

A fifth, short run checks that a peer dying after start-up fails the run
within seconds, naming it.

Cost: 10 processes of ~10-15 s of CPU each (XLA compilation above all);
BUILD_NOTES "Multi-host" has the measured wall time.
"""

import json
import pathlib
import sys
import tempfile
import time

import numpy as np
import pytest
from absl.testing import absltest

from jaxtopk import parallel
from tests.parallel import truth
from tests.parallel.multiprocess import worker
from tests.tolerances import tol

_ROOT = pathlib.Path(__file__).resolve().parents[3]
_TIMEOUT_S = 300  # per run; a healthy run takes 10-60 s on 2 cores
_STOP_B = 3  # B stops (and checkpoints) after this Top-k step
_INT_FIELDS = ("k_kept", "keys_scored", "valid", "length")
# One prefill and one decode case of worker.py's (every process compiles
# each): the KV positions split over all 8 devices, a count policy and
# Certified, a key mask. The training shards the data and heads axes.
_CASES = ("prefill_kv8_fixedk", "decode_kv8_certified")


def _launch(out, num_processes, devices, *flags, distributed=None):
  return parallel.launch.LocalCluster(
    [sys.executable, "-m", "tests.parallel.multiprocess.worker"]
    + [f"--out={out}", f"--cases={','.join(_CASES)}", *flags],
    num_processes=num_processes,
    devices_per_process=devices,
    timeout_s=_TIMEOUT_S,
    cwd=_ROOT,
    log_dir=pathlib.Path(out, "logs"),
    distributed=distributed,
  )


def _finalized_steps(workdir, phase="topk"):
  """Checkpoint steps orbax has finalised (renamed from their tmp dir)."""
  path = pathlib.Path(workdir, "ckpt", phase)
  if not path.is_dir():
    return []
  return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit())


def _load(out, stage, process=0):
  with np.load(pathlib.Path(out, f"process_{process}_{stage}.npz")) as f:
    return dict(f)


def _info(out, stage, process=0):
  return json.loads(
    pathlib.Path(out, f"process_{process}_{stage}.json").read_text()
  )


def _train_rows(workdir):
  with open(pathlib.Path(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [(r["phase"], r["step"], r["loss"], r["acc"]) for r in rows]


def _kept_from_float64(s, valid, k_kept, err):
  """The top-``k_kept`` valid keys of float64 logits ``s`` ``[..., n]``.

  The sharded paths keep an upper set of their float32 logits; it is this
  set unless float32 rounding (at most ``err`` per logit, per row) could
  reorder the k-th and (k+1)-th keys, which the gap check rules out: it
  fails loudly rather than skip a row.
  """
  order = np.argsort(-np.where(valid, s, -np.inf), axis=-1, kind="stable")
  ranks = np.argsort(order, axis=-1)
  keep = (ranks < k_kept[..., None]) & valid
  srt = np.take_along_axis(np.where(valid, s, -np.inf), order, axis=-1)
  n_valid = valid.sum(-1)
  for idx in np.ndindex(k_kept.shape):
    k, nv = int(k_kept[idx]), int(n_valid[idx])
    if 0 < k < nv:
      gap = srt[idx][k - 1] - srt[idx][k]
      assert gap > 2 * err[idx], (idx, gap, err[idx])
  return keep


class MultiProcessTest(absltest.TestCase):
  # One test method runs the four runs and then every check (as subtests):
  # a class-level fixture shared by several methods could be set up twice
  # when pytest-xdist sends the methods to different workers.
  @pytest.mark.slow
  def test_pod_runs(self):
    cases = worker.prefill_cases() + worker.decode_cases()
    self.assertContainsSubset(_CASES, [case[0] for case in cases])
    self._run_all()
    for check in (
      self._check_every_process_saw_one_8_device_mesh,
      self._check_every_process_returns_the_same_global_result,
      self._check_multi_process_is_bitwise_the_one_process_gloo_run,
      self._check_in_process_collectives_agree_within_tolerance,
      self._check_prefill_certificates_sound_against_float64,
      self._check_decode_certificates_sound_against_float64,
      self._check_sigkill_left_a_restorable_checkpoint,
      self._check_resumed_loss_curve_is_the_uninterrupted_one,
    ):
      with self.subTest(check=check.__name__[len("_check_") :]):
        check()

  @pytest.mark.slow
  def test_a_dead_peer_fails_fast_and_is_named(self):
    # Process 1 dies after start-up; process 0 waits for it in the first
    # collective of the prefill until the cluster kills it.
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    out = pathlib.Path(tmp, "crash")
    t0 = time.monotonic()
    with _launch(out, 2, 4, "--prefill", "--crash_process=1") as cluster:
      with self.assertRaises(parallel.launch.ClusterError) as ctx:
        cluster.wait()
    self.assertLess(time.monotonic() - t0, _TIMEOUT_S / 2)  # not the deadline
    msg = str(ctx.exception)
    self.assertIn("process 1 of 2 failed with exit status 1", msg)
    self.assertIn("RuntimeError: injected failure in process 1", msg)
    self.assertIn("--- process 0 (exit status -9)", msg)  # killed, reported
    self.assertEqual(cluster.returncodes()[0], -9)

  def _run_all(self):
    self.tmp = pathlib.Path(
      self.enter_context(tempfile.TemporaryDirectory(prefix="jaxtopk_mp_"))
    )
    tmp = self.tmp
    self.r0, self.a, self.b, self.c = (tmp / x for x in ("r0", "a", "b", "c"))
    self.chain = tmp / "chain"  # one training workdir for A, B and C
    both = ("--prefill", "--decode")
    r0_train = f"--train_workdir={self.r0 / 'train'}"
    chain = f"--train_workdir={self.chain}"
    with _launch(self.r0, 1, 8, *both, r0_train, distributed=True) as r0:
      r0.wait()
    with _launch(self.a, 2, 4, *both, chain) as a:
      a.wait_until(
        lambda: any(s >= 2 for s in _finalized_steps(self.chain)),
        what="A's first finalised Top-k checkpoint",
      )
      self.a_killed_running = a.kill(0)  # SIGKILL, mid-run
      self.a_steps_at_kill = _finalized_steps(self.chain)
    # Leaving the block killed process 1 too (its peer is gone).
    stop = f"--train_stop_at={_STOP_B}"
    with _launch(self.b, 4, 2, "--decode", chain, stop) as b:
      b.wait()
    with _launch(self.c, 1, 8, "--decode", chain) as c:
      c.wait()

  def _runs(self):
    """(name, out dir, processes, devices each, stages, gloo)."""
    return (
      ("R0", self.r0, 1, 8, ("prefill", "decode", "train"), True),
      ("A", self.a, 2, 4, ("prefill", "decode"), True),
      ("B", self.b, 4, 2, ("decode", "train"), True),
      ("C", self.c, 1, 8, ("decode", "train"), False),
    )

  def _check_every_process_saw_one_8_device_mesh(self):
    for name, out, procs, local, stages, gloo in self._runs():
      for stage in stages:
        for i in range(procs):
          info = _info(out, stage, i)
          with self.subTest(run=name, stage=stage, process=i):
            self.assertEqual(info["process_index"], i)
            self.assertEqual(info["process_count"], procs)
            self.assertEqual(info["device_count"], 8)
            self.assertEqual(info["local_device_count"], local)
            self.assertEqual(info["initialized"], gloo)

  def _check_every_process_returns_the_same_global_result(self):
    for name, out, procs, _, stages, _ in self._runs():
      for stage in stages:
        first = _load(out, stage)
        for i in range(1, procs):
          other = _load(out, stage, i)
          self.assertEqual(sorted(other), sorted(first))
          for key, value in first.items():
            with self.subTest(run=name, process=i, key=key):
              np.testing.assert_array_equal(other[key], value)

  def _check_multi_process_is_bitwise_the_one_process_gloo_run(self):
    for name, out, stage in (
      ("A", self.a, "prefill"),
      ("A", self.a, "decode"),
      ("B", self.b, "decode"),
    ):
      ref, got = _load(self.r0, stage), _load(out, stage)
      self.assertEqual(sorted(got), sorted(ref))
      for key in ref:
        with self.subTest(run=name, key=key):
          np.testing.assert_array_equal(got[key], ref[key])

  def _check_in_process_collectives_agree_within_tolerance(self):
    ref, got = _load(self.r0, "decode"), _load(self.c, "decode")
    for key in ref:
      with self.subTest(key=key):
        if key.split("/")[-1] in _INT_FIELDS:
          np.testing.assert_array_equal(got[key], ref[key])
        else:  # the all-reduce sums in another order: a few ulps
          np.testing.assert_allclose(got[key], ref[key], **tol(np.float32))

  def _check_prefill_certificates_sound_against_float64(self):
    got = _load(self.a, "prefill")  # = R0's (bitwise, tested)
    for seed, case in enumerate(worker.prefill_cases()):
      name, _, _, kv_heads, masked, causal = case
      if not worker.wanted(name, _CASES):
        continue
      q, k, v, mask = worker.prefill_inputs(seed, kv_heads)
      group = worker.H // kv_heads
      qh = q.transpose(0, 2, 1, 3)  # [b, h, t, d]
      kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)  # [b, h, n, d]
      vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)
      valid = np.ones((worker.B, worker.H, worker.T, worker.N), bool)
      if masked:
        valid &= mask
      if causal:
        valid &= np.tril(np.ones((worker.T, worker.N), bool))
      with self.subTest(case=name):
        self._check_sound(got, name, qh, kh, vh, valid, t_axis=1)

  def _check_decode_certificates_sound_against_float64(self):
    for out in (self.a, self.c):  # gloo (= R0, B) and in-process
      got = _load(out, "decode")
      for seed, (name, _, _) in enumerate(worker.decode_cases()):
        if not worker.wanted(name, _CASES):
          continue
        k, v, q, k_new, v_new = worker.decode_inputs(seed)
        keys = np.concatenate([k, k_new], 1).transpose(0, 2, 1, 3)
        values = np.concatenate([v, v_new], 1).transpose(0, 2, 1, 3)
        kh = np.repeat(keys, worker.DG, axis=1)  # [b, h, n, d]
        vh = np.repeat(values, worker.DG, axis=1)
        qh = q.transpose(0, 2, 1, 3)  # [b, h, 1, d]
        valid = np.ones((*qh.shape[:3], kh.shape[2]), bool)
        np.testing.assert_array_equal(got[f"{name}/length"], kh.shape[2])
        with self.subTest(run=str(out), case=name):
          self._check_sound(got, name, qh, kh, vh, valid, t_axis=1)

  def _check_sound(self, got, name, qh, kh, vh, valid, *, t_axis):
    """tv and output-error bounds >= float64 truth; output = kept attention.

    Certificate fields are ``[b, t, h]`` (jax.nn layout); the truth is
    head-major ``[b, h, t]``.
    """
    to_bht = lambda x: np.moveaxis(x, t_axis, 2)  # noqa: E731
    k_kept = to_bht(got[f"{name}/k_kept"])
    s = np.einsum(
      "bhtd,bhsd->bhts", qh.astype(np.float64), kh.astype(np.float64)
    ) / np.sqrt(qh.shape[-1])
    # Rounding of a float32 logit (as in _kv_sharded.py): (d + 2) eps scale
    # |q| max |k|, doubled for the norms' own rounding.
    d = qh.shape[-1]
    q_norm = np.linalg.norm(qh, axis=-1)  # [b, h, t]
    k_norm = np.linalg.norm(kh, axis=-1).max(-1)[..., None]  # [b, h, 1]
    err = 2 * (d + 2) * np.finfo(np.float32).eps / np.sqrt(d) * q_norm * k_norm
    keep = _kept_from_float64(s, valid, k_kept, err)
    tau, err, mu_head = truth.dense_truth(qh, kh, vh, valid, keep)
    tv = to_bht(got[f"{name}/tv_bound"])
    bound = to_bht(got[f"{name}/output_error_bound"])
    real = valid.any(-1)
    np.testing.assert_array_equal(to_bht(got[f"{name}/valid"]), real)
    self.assertTrue(np.all(tv[real] >= tau[real]), (tv - tau)[real].min())
    self.assertTrue(np.all(bound[real] >= err[real]))
    out = np.moveaxis(got[f"{name}/out"], t_axis, 2)  # [b, h, t, e]
    np.testing.assert_allclose(out[real], mu_head[real], **tol(np.float32))

  def _check_sigkill_left_a_restorable_checkpoint(self):
    self.assertTrue(self.a_killed_running, "A ended before it was killed")
    latest = max(self.a_steps_at_kill)
    self.assertGreaterEqual(latest, 2)
    self.assertLess(latest, worker.TRAIN_STEPS, "A was not killed mid-run")
    # B resumed from exactly the last checkpoint A finalised.
    self.assertEqual(int(_load(self.b, "train")["train_start_step"]), latest)
    self.assertEqual(int(_load(self.c, "train")["train_start_step"]), _STOP_B)

  def _check_resumed_loss_curve_is_the_uninterrupted_one(self):
    ref = _train_rows(self.r0 / "train")
    got = _train_rows(self.chain)  # A, then B (2 -> 4), then C (4 -> 1)
    steps = [("base", 1)]
    steps += [("topk", s) for s in range(1, worker.TRAIN_STEPS + 1)]
    self.assertEqual([r[:2] for r in ref], steps)
    self.assertEqual([r[:2] for r in got], steps)  # redone steps dropped
    # Steps up to B's stop ran on gloo: bitwise equal (loss and accuracy).
    self.assertEqual(got[:-1], ref[:-1])
    # C's step ran with in-process collectives: equal within tolerance.
    np.testing.assert_allclose(got[-1][2:], ref[-1][2:], **tol(np.float32))
    final, ref_final = _load(self.c, "train"), _load(self.r0, "train")
    for key in ref_final:
      if key.startswith("train_param"):
        with self.subTest(key=key):
          np.testing.assert_allclose(
            final[key], ref_final[key], **tol(np.float32)
          )


if __name__ == "__main__":
  absltest.main()
