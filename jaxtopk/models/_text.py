"""Real English text shipped with jaxtopk (public domain), for real rows.

The MiniLM experiments and notebooks need real prose with no network and on
any operating system. The package ships one public-domain book, Ambrose
Bierce's "The Devil's Dictionary" (1911; about 61,000 words), as package
data; ``jaxtopk/models/data/SOURCE.txt`` records where the file comes from
and what was changed.
"""

import functools
import importlib.resources

TEXT_NAME = "the_devils_dictionary.txt"


@functools.cache
def public_domain_text() -> str:
  """The full text of Bierce's "The Devil's Dictionary" (public domain).

  Returns:
    The book as one string (ASCII, ``\\n`` line ends), read from the
    package's data (never from a system path).

  Example:
    >>> from jaxtopk import models
    >>> words = models.public_domain_text().split()
    >>> len(words) > 60_000, words[:3]
    (True, ['The', 'Internet', 'Wiretap'])
  """
  path = importlib.resources.files("jaxtopk.models") / "data" / TEXT_NAME
  return path.read_text(encoding="ascii")
