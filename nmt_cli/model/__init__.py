"""The Transformer of "Attention Is All You Need" (arXiv 1706.03762, section 3) and its incremental
decoder (`transformer`), how its attention and dropout run on each device (`kernels`), the model
file every stage reads (`file`), and whether this CPU has native bf16 (`cpu`).

May import: `nmt_cli.data` (the dictionary), `nmt_cli.config`, `artifacts`, `errors`, `hooks`. Never
`training`, `inference` or `torch.distributed`: the model knows nothing of DDP, checkpoints or search.
"""
