"""The Transformer of "Attention Is All You Need" (arXiv 1706.03762, section 3) and its incremental
decoder.

May import: `nmt_cli.data` (the dictionary's special ids), `nmt_cli.config`. Never `training`,
`inference` or `torch.distributed`: the model knows nothing of DDP, checkpoints or search.
"""
