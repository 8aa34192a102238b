"""Page format and the fp8 codec."""

from kvtier.format.codec import dequantize, quantize
from kvtier.format.page_format import DTYPES, FP8_DTYPES, FP8_MAX, PageFormat, canonical_dtype

__all__ = ["DTYPES", "FP8_DTYPES", "FP8_MAX", "PageFormat", "canonical_dtype", "dequantize", "quantize"]
