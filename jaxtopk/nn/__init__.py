"""jaxtopk.nn."""

# Native Top-k decoder and selectors (issue 7).
from jaxtopk.nn._decoder import DecodeCache
from jaxtopk.nn._decoder import DecoderConfig
from jaxtopk.nn._decoder import TopKDecoder
from jaxtopk.nn._decoder import decode_teacher_forced
from jaxtopk.nn._selectors import ApproxMaxK
from jaxtopk.nn._selectors import CertifiedTopP
from jaxtopk.nn._selectors import ExactTopK
from jaxtopk.nn._selectors import MixedTopK
from jaxtopk.nn._selectors import selection_precision
