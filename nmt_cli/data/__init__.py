"""From raw text to token ids: `nmt prepare` (download, extract, clean, toy corpora), `nmt bpe`
(sentencepiece), `nmt binarize` (dictionary and memory-mapped arrays), and the dataset readers and
token-budget batching that training and translation use.

May import: `nmt_cli.config`, `nmt_cli.artifacts`, `nmt_cli.errors`, `nmt_cli.progress`. Never torch,
the model, training or inference.
"""
