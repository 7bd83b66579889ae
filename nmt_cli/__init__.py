"""nmt: neural machine translation from raw text to BLEU, the Transformer way."""

__version__ = "0.1.0"
