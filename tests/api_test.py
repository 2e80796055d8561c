"""The shape of the package: documented public names, imports only downward.

- Every public name of every package (what its ``__init__`` exports) that is
  a function or class defined in jaxtopk has a docstring.
- The import graph goes only downward (DESIGN.md layers):
  theory <- selection <- attention <- kernels <- nn <- models, with parallel
  beside (it may use theory, selection and attention; nothing but the
  top-level package imports it) and tasks standalone. Below them all,
  leaf modules at the top level (``jaxtopk._deprecation``) that import
  nothing from jaxtopk; every layer may use them.
- No module imports another package's private module or name
  (``from jaxtopk.selection import _certify`` inside jaxtopk/attention);
  layers above use a package's public or documented internal API (e.g.
  ``jaxtopk.theory.internal``: ``compute_dtype``, ``log_slack``). Known
  cases in files under other owners' work are listed in
  ``KNOWN_PRIVATE_IMPORTS`` so the test fails on any new one; an entry that
  no longer occurs fails too, so the list only shrinks.
"""

import ast
import importlib
import inspect
import pathlib
import re

from absl.testing import absltest
from absl.testing import parameterized

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO / "jaxtopk"

PACKAGES = (
  "jaxtopk",
  "jaxtopk.theory",
  "jaxtopk.theory.internal",  # documented internal API for the layers above
  "jaxtopk.selection",
  "jaxtopk.selection.internal",  # documented internal API for the layers above
  "jaxtopk.attention",
  "jaxtopk.kernels",
  "jaxtopk.kernels.decode",
  "jaxtopk.kernels.prefill",
  "jaxtopk.kernels.select",
  "jaxtopk.kernels.sparse_flash",
  "jaxtopk.kernels.stats",
  "jaxtopk.nn",
  "jaxtopk.models",
  "jaxtopk.parallel",
  "jaxtopk.parallel.flags",
  "jaxtopk.parallel.launch",
  "jaxtopk.tasks",
)

# What each package may import from the other jaxtopk packages.
_STACK = ("theory", "selection", "attention", "kernels", "nn", "models")
ALLOWED = {name: set(_STACK[:i]) for i, name in enumerate(_STACK)}
ALLOWED["parallel"] = {"theory", "selection", "attention"}
ALLOWED["tasks"] = set()
# Top-level modules below every layer (they import nothing from jaxtopk).
LEAVES = ("_deprecation",)

# file -> private modules of OTHER packages it imports. Empty:
# every layer uses the public or documented internal API (e.g.
# jaxtopk.selection.core); keep it empty.
KNOWN_PRIVATE_IMPORTS = {}


def _modules():
  """(path relative to jaxtopk/, package name or None for top level)."""
  for path in sorted(PACKAGE_DIR.rglob("*.py")):
    rel = path.relative_to(PACKAGE_DIR)
    yield rel, (rel.parts[0] if len(rel.parts) > 1 else None)


def _imports(path):
  """Fully qualified jaxtopk modules/names imported by ``path``."""
  tree = ast.parse(path.read_text(), filename=str(path))
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out += [a.name for a in node.names if a.name.startswith("jaxtopk")]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      mod = node.module or ""
      if mod == "jaxtopk" or mod.startswith("jaxtopk."):
        out += [f"{mod}.{a.name}" for a in node.names]
  return out


def _private_target(name: str) -> str | None:
  """The private module named by a jaxtopk import, if any."""
  parts = name.split(".")
  for i, part in enumerate(parts):
    if part.startswith("_") and not part.startswith("__"):
      return ".".join(parts[: i + 1])
  return None


class PublicApiTest(parameterized.TestCase):
  @parameterized.named_parameters((p, p) for p in PACKAGES)
  def test_public_names_are_documented(self, package):
    module = importlib.import_module(package)
    self.assertTrue((module.__doc__ or "").strip(), f"{package} docstring")
    undocumented = []
    for name in dir(module):
      if name.startswith("_"):
        continue
      obj = getattr(module, name)
      if inspect.ismodule(obj):
        continue
      if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        continue  # constants: documented where they are defined
      if not getattr(obj, "__module__", "").startswith("jaxtopk"):
        continue  # re-exported from another library
      if not (obj.__doc__ or "").strip():
        undocumented.append(name)
    self.assertEqual(undocumented, [], f"{package}: names without docstring")

  @parameterized.named_parameters((p, p) for p in PACKAGES)
  def test_all_lists_the_public_names(self, package):
    module = importlib.import_module(package)
    self.assertTrue(hasattr(module, "__all__"), f"{package}.__all__")
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    self.assertEqual(missing, [], f"{package}.__all__ names what is absent")
    public = {  # every public function, class and constant (not modules)
      n
      for n, obj in vars(module).items()
      if not n.startswith("_") and not inspect.ismodule(obj)
    }
    self.assertEqual(public - set(module.__all__), set(), package)

  def test_models_and_nn_exports(self):
    import jaxtopk  # noqa: F401 (the top-level package loads every layer)

    nn = importlib.import_module("jaxtopk.nn")
    models = importlib.import_module("jaxtopk.models")
    for name in ("CertifiedTopKAttention", "topk_attention_fn"):
      self.assertTrue(hasattr(nn, name), name)
    for name in ("TopKDecoder", "load_minilm", "sentence_embedding"):
      self.assertFalse(hasattr(nn, name), f"{name} belongs to models")
      self.assertTrue(hasattr(models, name), name)

  def test_moved_parallel_names_warn_and_resolve(self):
    parallel = importlib.import_module("jaxtopk.parallel")
    for name, where in (
      ("LocalCluster", parallel.launch),
      ("launch_local", parallel.launch),
      ("define_mesh_flag", parallel.flags),
    ):
      self.assertNotIn(name, parallel.__all__)
      with self.assertWarnsRegex(DeprecationWarning, f"parallel.{name}"):
        self.assertIs(getattr(parallel, name), getattr(where, name))
    with self.assertRaisesRegex(AttributeError, "no_such_name"):
      parallel.no_such_name  # noqa: B018

  def test_merge_attention_exports(self):
    for package in ("jaxtopk", "jaxtopk.attention"):
      module = importlib.import_module(package)
      self.assertIn("merge_attention", module.__all__, package)
    jaxtopk = importlib.import_module("jaxtopk")
    self.assertIs(jaxtopk.merge_attention, jaxtopk.attention.merge_attention)


class ImportGraphTest(absltest.TestCase):
  def test_imports_only_go_down(self):
    bad = []
    for rel, package in _modules():
      if package is None:
        continue  # jaxtopk/__init__.py assembles every package
      for name in _imports(PACKAGE_DIR / rel):
        parts = name.split(".")
        if len(parts) == 1:
          bad.append(f"{rel}: import jaxtopk (the top-level package)")
          continue
        target = parts[1]
        if target in (package, "__version__", *LEAVES):
          continue
        if target not in ALLOWED[package]:
          bad.append(f"{rel}: imports jaxtopk.{target} (layer {package})")
    self.assertEqual(bad, [])

  def test_leaves_import_nothing_from_jaxtopk(self):
    for leaf in LEAVES:
      self.assertEqual(_imports(PACKAGE_DIR / f"{leaf}.py"), [], leaf)

  def test_no_new_private_cross_package_imports(self):
    found = {}
    for rel, package in _modules():
      for name in _imports(PACKAGE_DIR / rel):
        target = _private_target(name)
        if target is None or target.split(".")[1] in (package, *LEAVES):
          continue
        found.setdefault(rel.as_posix(), set()).add(target)
    new = {
      f: sorted(m - KNOWN_PRIVATE_IMPORTS.get(f, set()))
      for f, m in found.items()
      if m - KNOWN_PRIVATE_IMPORTS.get(f, set())
    }
    self.assertEqual(new, {}, "use the public or documented internal API")
    gone = {
      f: sorted(m - found.get(f, set()))
      for f, m in KNOWN_PRIVATE_IMPORTS.items()
      if m - found.get(f, set())
    }
    self.assertEqual(gone, {}, "fixed: remove these from the known list")


# "THEORY 3.3", "THEORY.md section 1", "THEORY 4.2/4.4", "THEORY 3.1-3.3".
_CITATION = re.compile(
  r"THEORY(?:\.md)?(?: sections?)? (\d+(?:\.\d+)?(?:[/-]\d+(?:\.\d+)?)*)"
)


class TheoryCitationTest(absltest.TestCase):
  def test_every_citation_names_a_section_of_theory_md(self):
    text = (REPO / "THEORY.md").read_text()
    sections = set(re.findall(r"^## (\d+)\. ", text, re.M))
    sections |= set(re.findall(r"^\*\*(\d+\.\d+)\*\*", text, re.M))
    self.assertGreater(len(sections), 40)
    cited = {}
    for folder in ("jaxtopk", "experiments", "colab", "tests"):
      for path in (REPO / folder).rglob("*.py"):
        for match in _CITATION.finditer(path.read_text()):
          for number in re.split(r"[/-]", match.group(1)):
            cited.setdefault(number, path.relative_to(REPO).as_posix())
    self.assertGreater(len(cited), 30)
    missing = {n: f for n, f in cited.items() if n not in sections}
    self.assertEqual(missing, {}, "cited but absent from THEORY.md")


if __name__ == "__main__":
  absltest.main()
