"""`nmt translate` (`translate`): batched beam search (`search`) over the model's incremental decoder,
what the search asks of a model and which extensions it keeps (`beams`), the compiled decoder's
worker processes (`replicas`), several models searched as one (`ensemble`), `nmt export ctranslate2`
and the search of an exported folder (`ct2`), `nmt export huggingface` (`huggingface`), and a parser's
output back into a tree (`trees`); text read and written in input order.

What it may import is ARCHITECTURE.md's Packages table (tests/test_layers.py reads it). Never
`training`: a machine that only translates needs none of it.
"""
