"""`nmt translate`: batched beam search over the model's incremental decoder, the compiled decoder and
its worker processes, reading and writing text in input order.

May import: `data`, `model` (the model-file loader included), `config`, `artifacts`, `errors`,
`progress`. Never `training`: a machine that only translates needs none of it.
"""
