"""The usage examples in jaxtopk.nn and jaxtopk.models docstrings run."""

import doctest

from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk.models import _decoder
from jaxtopk.models import _generate
from jaxtopk.models import _pretrained
from jaxtopk.models import _text
from jaxtopk.nn import _attention
from jaxtopk.nn import _attention_fn
from jaxtopk.nn import _certificates
from jaxtopk.nn import _linen


class DocstringExampleTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (m.__name__.rsplit(".", 1)[-1], m)
    for m in (
      _attention,
      _attention_fn,
      _certificates,
      _linen,
      _decoder,
      _generate,
      _pretrained,
      _text,
    )
  )
  def test_examples(self, module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    self.assertGreater(result.attempted, 0)
    self.assertEqual(result.failed, 0)


if __name__ == "__main__":
  absltest.main()
