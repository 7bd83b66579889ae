"""`nmt train` and `nmt average`: the batch plan, the train step, loss, optimiser and schedule,
checkpoints and exact resume, DDP and torchrun, the training log.

The only package that touches `torch.distributed`. May import: `data`, `model`, `inference` (for
validation BLEU), `config`, `artifacts`, `errors`, `hooks`, `progress`. Never `cli`: torchrun's
workers start at `nmt_cli.worker`.
"""
