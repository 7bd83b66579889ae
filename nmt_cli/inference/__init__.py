"""`nmt translate`: batched beam search over the model's incremental decoder, the compiled decoder and
its worker processes, reading and writing text in input order.

May import: `data`, `model`, `config`, `artifacts`, `errors`, and the model-file loader of `training`.
"""
