"""From raw text to token ids: `nmt prepare` (`prepare`; downloads resumed and verified in `download`,
safe extraction in `archive`, the corpora in `wmt`, `toy` and `ptb`, Penn Treebank trees in
`treebank`, cleaning in `clean`, text through worker processes in order in `streaming`), `nmt bpe`
(`bpe`: sentencepiece), `nmt binarize` (`binarize`), and the dictionary, memory-mapped arrays and
token-budget batches that training and translation read (`dataset`).

What it may import is ARCHITECTURE.md's Packages table (tests/test_layers.py reads it). Never torch,
the model, training or inference.
"""
