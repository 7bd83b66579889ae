"""`nmt train` (`train`: the run) and `nmt average` (`average`): the batch plan (`corpus`), one
update (`step`), the loss (`loss`), optimiser and schedule (`optim`), what a run survives (`guard`),
`--init` (`finetune`), the save folder (`checkpoint`) and exact resume (`resume`, `counters`), DDP
and torchrun (`distributed`), the training log (`trainlog`), model FLOPs and the devices' peak
(`flops`).

The only package that touches `torch.distributed`. What it may import is ARCHITECTURE.md's Packages
table (tests/test_layers.py reads it). Never `cli`: torchrun's workers start at `nmt_cli.worker`.
"""
