"""The Transformer of "Attention Is All You Need" (arXiv 1706.03762, section 3), its incremental
decoder and `build_model`, the one place a model is made (`transformer`); how its attention, dropout,
ReLU and output projection run on each device (`kernels`), with the C kernels of translation on a
CPU (`native`) and its linear layers in int8 (`int8`); the model file every stage reads (`file`);
`nmt import fairseq` (`fairseq`, and `fairseq_pickle`, which reads fairseq's checkpoints as data);
`nmt import huggingface` and the MarianMT correspondence both ways (`huggingface`);
whether this CPU has native bf16 and a compiler (`cpu`).

What it may import is ARCHITECTURE.md's Packages table (tests/test_layers.py reads it). Never
`training`, `inference` or `torch.distributed`: the model knows nothing of DDP, checkpoints or search.
"""
